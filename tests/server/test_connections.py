"""The header-read deadline on a real uvicorn server: a client that never finishes its headers
(slowloris: a byte at a time) is cut off; one whose headers are in may send its body slowly."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from guided.server.door import HeaderTimeoutProtocol

TIMEOUT_S = 0.5


class ShortTimeout(HeaderTimeoutProtocol):
    header_timeout_s = TIMEOUT_S


async def echo_app(scope, receive, send):
    """Reads the whole body, answers with its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(echo_app, host="127.0.0.1", port=free,
                                           http=ShortTimeout, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield free
    server.should_exit = True
    thread.join(10)


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes sock within `seconds`, while we send trickle a byte at a time
    every 0.1 s."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return True
            sent += 1
    return False


def test_slowloris_headers_are_cut_off(port):
    trickle = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 100
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert closed_within(sock, TIMEOUT_S + 2.0, trickle)


def test_a_silent_connection_is_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert closed_within(sock, TIMEOUT_S + 2.0)


def test_the_next_request_on_a_kept_alive_connection_has_a_deadline_too(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        assert closed_within(sock, TIMEOUT_S + 2.0, b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100)


def test_a_slow_body_after_complete_headers_is_served(port):
    body = b"0123456789"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        for byte in body:  # 2 s of body: past the header deadline, which no longer applies
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        sock.settimeout(5)
        response = b""
        while not response.endswith(b"\r\n\r\n10"):
            chunk = sock.recv(4096)
            assert chunk, response
            response += chunk
    assert b"200 OK" in response
