"""A fixed sample of the shared JSON-schema material: no invalid instance may pass the grammar."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from grammar_soundness import FILES, Checker, load_cases


@pytest.fixture(scope="module")
def sample():
    if not FILES:
        pytest.skip("the shared JSON-schema material is not available")
    cases = load_cases(limit_per_file=40)
    small = [c for c in cases if len(str(c.schema)) < 6000]  # keep the test fast
    by_subset: dict[str, list] = {}
    for case in small:
        by_subset.setdefault(case.subset, []).append(case)
    rng = random.Random(0)
    picked = []
    for subset in sorted(by_subset):
        picked += rng.sample(by_subset[subset], min(4, len(by_subset[subset])))
    return picked


def test_no_false_accepts_on_sample(sample, tokenizer):
    checker = Checker("tokens", any_whitespace=True, max_whitespace=2, timeout_s=20,
                      tokenizer=tokenizer)
    try:
        outcomes = [checker.run(case) for case in sample]
    finally:
        checker.close()
    accepted = [o for o in outcomes if o.refused is None]
    false_accepts = [(o.schema_id, fa) for o in outcomes for fa in o.false_accepts]
    assert len(sample) >= 50
    assert len(accepted) >= 0.6 * len(sample), [o.refused for o in outcomes if o.refused]
    assert not false_accepts, false_accepts
    valid = sum(o.num_valid for o in accepted)
    rejected = sum(len(o.false_rejects) for o in accepted)
    assert rejected <= 0.3 * valid, [o.false_rejects[:1] for o in accepted if o.false_rejects]


def test_compact_grammars_have_no_false_accepts_and_their_random_outputs_validate(sample,
                                                                                 tokenizer):
    """Compact separators (the engine's default): labelled invalid instances refused, and
    random outputs drawn from the grammar's own masks validate against their schemas."""
    checker = Checker("bytes", any_whitespace=False, max_whitespace=2, timeout_s=20,
                      tokenizer=tokenizer, walks=3)
    try:
        outcomes = [checker.run(case) for case in sample]
    finally:
        checker.close()
    served = [o for o in outcomes if o.refused is None]
    false_accepts = [(o.schema_id, fa) for o in outcomes for fa in o.false_accepts]
    assert len(served) >= 0.5 * len(sample), [o.refused for o in outcomes if o.refused]
    assert sum(o.num_walks for o in served) >= 2 * len(served)
    assert not false_accepts, false_accepts
