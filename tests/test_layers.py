"""The layers of DESIGN.md, held: the import-linter contracts in pyproject.toml, checked on
every run of the suite (arrows go down only; the worker knows no grammar; the scheduler knows
no tensors; fsm knows no batching)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's guided, wherever it is installed
    result = subprocess.run([str(lint)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout
