"""The HTTP connection's own limit: a client must send a request's headers within
HEADER_TIMEOUT_S of connecting (or of its previous response), else the connection is closed.
uvicorn has no such timeout: its keep-alive timer is cancelled by any byte received, so a client
trickling a header a byte at a time (slowloris) held a connection, and its memory, forever."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools' or h11's) with a header-read deadline."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self._in_request():
            self._header_timer.cancel()  # the request's headers are in
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm_header_timer()  # the next request's headers have a deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        """Headers of a request were read and its response is not complete yet."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()
