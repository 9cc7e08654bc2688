"""Refusing a generation request at the first layer of the router's HTTP app when its gate is
full, before FastAPI routes it.

Why: in a burst every refused request still went through FastAPI's routing, its dependency
and exception machinery and the endpoint before the gate (router/gate.py) refused it; on two
cores a 1000-client burst then took 1.0-1.5 s to refuse its last client (docs/ROBUSTNESS.md).
Here a request the gate would refuse is answered with the same 429 (OpenAI error body,
Retry-After) from the raw ASGI call. The endpoint's own check stays: a request let through
here can still find the gate full there, and is refused the same way.

Only requests that would be admitted otherwise are shed: with API keys required, a request
without a valid key goes on to its 401.
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from router.errors import overloaded

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Shedder:
    """What the middleware asks of the router replica (installed when it starts)."""

    def __init__(self, admits: Callable[[], bool], authorized: Callable[[str | None], bool],
                 refused: Callable[[], None], retry_after_s: int):
        self.admits, self.authorized, self.refused = admits, authorized, refused
        error = overloaded(retry_after_s)
        self.status = error.status
        self.body = json.dumps(error.body()).encode()
        self.headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode()),
                        *((name.lower().encode(), value.encode()) for name, value in error.headers.items())]


_installed: Shedder | None = None


def install(shedder: Shedder | None) -> None:
    """The router replica's shedder, for this process. A module global, not the app's state:
    Serve runs a copy of the FastAPI app it was given (pickled with the deployment), so the app
    object the router could reach is not the one that serves; a Serve replica is a process of
    its own, with one router in it."""
    global _installed
    _installed = shedder


class ShedWhenFull:
    """ASGI middleware: a generation POST that the gate would refuse gets its 429 here."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send) -> None:
        shedder = _installed
        if (shedder is not None and scope["type"] == "http" and scope["method"] == "POST"
                and _route(scope) in GENERATION_PATHS and not shedder.admits()
                and shedder.authorized(_header(scope, b"authorization"))):
            shedder.refused()
            await send({"type": "http.response.start", "status": shedder.status, "headers": shedder.headers})
            await send({"type": "http.response.body", "body": shedder.body})
            return
        await self.app(scope, receive, send)


def _route(scope: dict) -> str:
    """The path within the app: Serve mounts an app under its route prefix (root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
