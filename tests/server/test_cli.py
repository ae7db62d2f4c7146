"""`guided generate` as a user runs it: a constraint that cannot be compiled, or a schema file
that is missing or not JSON, is printed and exits non-zero; nothing leaks spam at exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "guided.server.cli", "generate", "--prompt", "hi",
                           "--max-tokens", "8", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (("--regex", "(abc"), "regex"),
    (("--json-schema", "no/such/file.json"), "no/such/file.json"),
    (("--grammar", "README.md"), "grammar"),
    (("--json-schema", "README.md"), "README.md is not valid JSON"),
])
def test_constraint_errors_are_printed_and_exit_non_zero(args, words):
    out = generate(*args)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("guided generate: ") and words in out.stderr, out.stderr
    assert "nanobind" not in out.stderr
