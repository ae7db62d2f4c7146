"""--api-key: every route but /health wants `Authorization: Bearer <key>` (as vLLM's server and
the OpenAI clients send it); anything else is a 401 with OpenAI's error body."""
from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health"})  # load balancers and supervisors probe it without a key


class ApiKeyMiddleware:
    """A pure ASGI middleware (no per-request task or body copy, so streams are untouched)."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "a valid API key is required: send `Authorization: Bearer <key>`",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # the key compared in constant time: its length and bytes leak nothing
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self._key)
        return False
