"""benchmarks/profile_sampled.py's reading of py-spy's raw stacks: samples split by the marker
frame of each mode, other threads' and unmarked samples left out, ms a step per function."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_sampled

MAIN = "thread (1): MainThread;<module> (profile_sampled.py:140);child (profile_sampled.py:49)"


def test_samples_split_by_mode_and_counted_per_step(tmp_path, capsys):
    stacks = tmp_path / "stacks.txt"
    constrained = f"{MAIN};child.<locals>.measured_constrained (profile_sampled.py:42)"
    step = "Engine.step (guided/engine/core.py:197)"
    stacks.write_text("\n".join([
        f"{constrained};{step};Engine._update (guided/engine/core.py:245) 30",
        f"{constrained};{step};ModelRunner.prepare (guided/worker/model_runner.py:9) 10",
        f"{MAIN};child.<locals>.measured_free (profile_sampled.py:45);{step} 20",
        f"{MAIN};compile_all (engine_offline.py:83);Engine.step (guided/engine/core.py:197) 500",
        "thread (2): grammar-compile-0;_work (guided/fsm/compiler.py:230) 900",
    ]) + "\n")
    profile_sampled.analyze(str(stacks), {"constrained": 10, "free": 4}, rate=1000, top=5)
    out = capsys.readouterr().out
    # 40 samples at 1000 a second over 10 steps: 4 ms a step; 20 over 4 steps: 5 ms
    assert "## constrained: 40 samples, 10 steps, 4.00 ms a step sampled" in out
    assert "## free: 20 samples, 4 steps, 5.00 ms a step sampled" in out
    constrained = out.split("## free")[0]
    assert "   3.000 | guided/engine/core.py:Engine._update" in constrained
    assert "   4.000 | guided/engine/core.py:Engine.step" in constrained  # inclusive
    assert "compiler.py" not in out
