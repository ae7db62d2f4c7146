"""A real `guided serve` subprocess (default model, CPU settings) shared by the e2e tests.

Extra server flags can be given in GUIDED_TEST_SERVER_ARGS (e.g. "--no-jump-forward")."""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory):
    """launch(*serve_args) -> (url, process): a `guided serve` on a free 127.0.0.1 port, up and
    healthy; every server still running is stopped at the end of the session."""
    started: list[tuple[subprocess.Popen, object, object]] = []

    def launch(*args: str, name: str = "server") -> tuple[str, subprocess.Popen]:
        port = _free_port()
        log_path = tmp_path_factory.mktemp(name) / "server.log"
        cmd = [sys.executable, "-m", "guided.server.cli", "serve", "--port", str(port),
               "--log-level", "info", *args]
        log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        started.append((proc, log, log_path))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n"
                            f"{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url, proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)

    yield launch
    for proc, log, log_path in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        print(f"\nserver log: {log_path}")


@pytest.fixture(scope="session")
def server_url(launch_server) -> str:
    url, _ = launch_server("--max-num-seqs", "32",
                           *shlex.split(os.environ.get("GUIDED_TEST_SERVER_ARGS", "")))
    return url


@pytest.fixture(scope="session")
def client(server_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def async_client(server_url):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0,
                              timeout=300)
