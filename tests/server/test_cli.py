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


@pytest.mark.slow
def test_choice_stays_in_the_list_as_the_cli_runs_it():
    """`guided generate --prompt "Is the sky blue?" --chat --choice yes,no` once printed `No`
    (2 of 19 runs). The CLI's path (LLM.chat, greedy, a grammar compiled cold) many times, with
    compile delays drawn at random (a loaded CPU's timing); every output one of the choices."""
    import random
    import time

    from guided.fsm.backends import xgrammar_backend
    from guided.llm import LLM
    from guided.params import SamplingParams

    out = generate("--chat", "--choice", "yes,no")
    assert out.returncode == 0 and out.stdout.strip() in ("yes", "no"), out
    compile_recipe = xgrammar_backend.XGrammarBackend.compile
    rng = random.Random(0)

    def late_compile(self, recipe):
        time.sleep(rng.choice([0.0, 0.0, 0.01, 0.05, 0.2]))
        return compile_recipe(self, recipe)

    mp = pytest.MonkeyPatch()
    mp.setattr(xgrammar_backend.XGrammarBackend, "compile", late_compile)
    try:
        llm = LLM()
        texts = []
        for _ in range(20):
            llm.engine.compiler._cache.clear()  # cold, as in a fresh `guided generate`
            [result] = llm.chat([[{"role": "user", "content": "Is the sky blue?"}]],
                                SamplingParams(choice=["yes", "no"], temperature=0,
                                               max_tokens=128))
            texts.append((result.text, result.finish_reason))
        llm.engine.shutdown()
    finally:
        mp.undo()
    assert {t for t, _ in texts} <= {"yes", "no"} and {r for _, r in texts} == {"stop"}, texts


def test_serve_refuses_a_missing_chat_template_file():
    out = subprocess.run([sys.executable, "-m", "guided.server.cli", "serve", "--port", "1",
                          "--chat-template", "no/such/template.jinja"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2 and "no/such/template.jinja" in out.stderr, out
