"""A generation request that the router's gate would refuse gets its 429 from the first layer
of the HTTP app (router/shedding.py), before FastAPI routes it; everything else goes on to the
endpoints, a request without a valid key to its 401. A real FastAPI app over ASGI, with the
same middleware and error body as the router's (tests/test_overload.py runs the whole router)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from router.auth import ApiKeys
from router.errors import overloaded
from router import shedding
from router.shedding import Shedder, ShedWhenFull

KEY = "sk-test"


def serve_app(admits: bool, keys: ApiKeys) -> tuple[FastAPI, list[str], list[int]]:
    app = FastAPI()
    app.add_middleware(ShedWhenFull)
    reached, refused = [], []

    @app.post("/v1/completions")
    async def completions(request: Request):
        reached.append(request.url.path)
        if not keys.authorized(request.headers.get("authorization")):
            return {"error": "unauthorized"}
        return {"ok": True}

    @app.get("/health")
    async def health():
        reached.append("/health")
        return {"status": "ok"}

    shedding.install(Shedder(lambda: admits, keys.authorized, lambda: refused.append(1), retry_after_s=7))
    return app, reached, refused


@pytest.fixture(autouse=True)
def uninstalled():
    yield
    shedding.install(None)


def send(app: FastAPI, method: str, path: str, key: str | None = None, root_path: str = "") -> httpx.Response:
    async def go():
        headers = {"authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.request(method, path, json={"prompt": "x"}, headers=headers)
    return asyncio.run(go())


def test_a_full_gate_refuses_generation_before_the_endpoint_with_the_routers_429():
    app, reached, refused = serve_app(admits=False, keys=ApiKeys([]))
    response = send(app, "POST", "/v1/completions")
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.json() == overloaded(7).body()
    assert reached == [] and refused == [1]
    assert send(app, "GET", "/health").status_code == 200 and reached == ["/health"]


def test_an_app_under_a_route_prefix_is_shed_too():
    """Serve mounts the app under its route prefix: the path then starts with the root path."""
    app, reached, refused = serve_app(admits=False, keys=ApiKeys([]))
    assert send(app, "POST", "/small/v1/completions", root_path="/small").status_code == 429
    assert reached == [] and refused == [1]


def test_with_room_in_the_gate_requests_reach_the_endpoint():
    app, reached, refused = serve_app(admits=True, keys=ApiKeys([]))
    assert send(app, "POST", "/v1/completions").json() == {"ok": True}
    assert reached == ["/v1/completions"] and refused == []


def test_a_request_without_a_valid_key_goes_on_to_its_401_even_when_full():
    app, reached, refused = serve_app(admits=False, keys=ApiKeys([KEY]))
    assert send(app, "POST", "/v1/completions", key="wrong").json() == {"error": "unauthorized"}
    assert reached == ["/v1/completions"] and refused == []
    assert send(app, "POST", "/v1/completions", key=KEY).status_code == 429
