"""Optional API keys for the /v1 endpoints.

Keys come from the environment variable SPECSERVE_API_KEYS (comma-separated) and from the
file that `server.api_keys_file` names (one key per line, '#' starts a comment), both read
where the router runs, so that cluster.yaml never holds a key. With no key from either,
every request is let through, as on a laptop. A presented key is compared with every known
key through SHA-256 digests and `hmac.compare_digest`, so the time taken tells nothing about
how much of a key was right, nor which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Mapping

from cluster.config import API_KEYS_ENV
from router.errors import unauthorized


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._digests = [_digest(key) for key in keys]

    @classmethod
    def load(cls, keys_file: Path | None, environ: Mapping[str, str] = os.environ) -> "ApiKeys":
        keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")]
        if keys_file is not None:
            lines = Path(keys_file).read_text(encoding="utf-8").splitlines()
            keys += [line.split("#", 1)[0].strip() for line in lines]
        return cls([k for k in keys if k])

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """Raise a 401 OpenAIError unless `authorization` is 'Bearer <a known key>'."""
        if not self.authorized(authorization):
            raise unauthorized()

    def authorized(self, authorization: str | None) -> bool:
        """Whether `authorization` is 'Bearer <a known key>' (or no key is required)."""
        if not self.required:
            return True
        scheme, _, presented = (authorization or "").partition(" ")
        digest = _digest(presented.strip())
        matched = False
        for known in self._digests:   # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, known)
        return scheme.lower() == "bearer" and matched
