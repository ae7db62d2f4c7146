"""README.md's code runs as written: the "Use it" blocks (a real `guided serve` on the port the
README names, `guided generate` with its outputs validated, the Python blocks), and every
benchmark command names a script that exists."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the README section `## <section>`."""
    start = README.index(f"## {section}\n")
    end = README.find("\n## ", start + 1)
    text = README[start:end if end != -1 else None]
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


def env() -> dict[str, str]:
    # this tree's guided, not an installed one; `guided` from the interpreter's environment
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": str(REPO), "PATH": path}


def test_benchmark_commands_name_scripts_that_exist():
    [(_, code)] = blocks("Benchmarks")
    scripts = re.findall(r"(?:python|bash) (?:\S+=\S+ )*(benchmarks/\S+\.(?:py|sh))", code)
    scripts += ["benchmarks/" + s for s in re.findall(r"cd benchmarks && python (\S+\.py)", code)]
    assert len(scripts) >= 5
    missing = sorted({s for s in scripts if not (REPO / s).is_file()})
    assert not missing, missing


GENERATE_CHECKS = [  # what each `guided generate` line of the README must print
    ("--json-schema examples/person.json", lambda out: jsonschema.validate(
        json.loads(out), json.loads((REPO / "examples/person.json").read_text()))),
    ("--regex", lambda out: re.fullmatch(r"\d{3}-\d{4}", out) or pytest.fail(out)),
    ("--choice", lambda out: out in ("yes", "no") or pytest.fail(out)),
]


@pytest.mark.slow
def test_use_it_blocks_run_as_written():
    [(lang, shell), *python_blocks] = blocks("Use it")
    assert lang == "bash" and all(lang == "python" for lang, _ in python_blocks)
    lines = [line for line in shell.splitlines() if line.strip()]
    [serve] = [line for line in lines if line.startswith("guided serve")]
    port = int(re.search(r"--port (\d+)", serve).group(1))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port}, which the README names, is taken on this machine")
    for line in lines:  # first, so that the server's start does not share the cores with them
        if line is serve:
            continue
        out = subprocess.run(["bash", "-c", line], cwd=REPO, env=env(), capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, (line, out.stderr[-2000:])
        assert "nanobind" not in out.stderr, out.stderr[-2000:]  # no leak spam at exit
        [check] = [c for flag, c in GENERATE_CHECKS if flag in line]
        check(out.stdout.strip())
    server = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=REPO, env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        for _, code in python_blocks:
            out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, (code, out.stderr[-2000:])
    finally:
        server.terminate()
        server.wait(60)


def _wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read().decode()[-2000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the README's server did not come up")
