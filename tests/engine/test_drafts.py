"""What anchored proposals teach the engine (guided/engine/drafts.py): the running payoff that decides
whether drafts are anchored on an in-flight sample."""
from __future__ import annotations

from guided.engine.drafts import AnchorPayoff


def allowed_in_steps(payoff: AnchorPayoff, num_steps: int, num_running: int) -> list[int]:
    """How many of num_running proposals the payoff anchors, step by step."""
    counts = []
    for _ in range(num_steps):
        payoff.start_step()
        counts.append(sum(payoff.allows(num_running) for _ in range(num_running)))
    return counts


def test_payoff_stops_anchoring_after_misses_but_still_probes():
    payoff = AnchorPayoff(min_gain=0.5, probe_every=8)
    assert payoff.allows()  # tried first
    for _ in range(200):
        payoff.note(-1)
    assert payoff.mean_gain < 0.5
    allowed = sum(allowed_in_steps(payoff, 800, 1))
    assert 60 <= allowed <= 140  # about one in probe_every, to see again


def test_probes_are_few_and_gathered_in_few_steps_of_a_large_batch():
    """At 256 requests: about probes_per_step in one step of probe_every, not one proposal in
    probe_every (32 a step, nearly every step a verify step)."""
    payoff = AnchorPayoff(min_gain=0.5, probe_every=8, probes_per_step=8)
    for _ in range(200):
        payoff.note(0)
    counts = allowed_in_steps(payoff, 400, 256)
    probing = [n for n in counts if n]
    assert 25 <= len(probing) <= 80  # about one step in eight
    assert 200 <= sum(counts) <= 600  # about 8 in each of those (against ~12800)
    assert max(counts) <= 25


def test_payoff_recovers_when_anchored_drafts_are_kept_again():
    payoff = AnchorPayoff(min_gain=0.5)
    for _ in range(200):
        payoff.note(-1)
    assert sum(allowed_in_steps(payoff, 40, 1)) < 40
    for _ in range(200):
        payoff.note(3)  # three drafts kept a proposal
    assert payoff.mean_gain > 2.5
    assert all(payoff.allows() for _ in range(50))


def test_payoff_that_gains_nothing_on_average_stays_off():
    """A random-weights model: misses (0), hits whose first draft is rejected (the next step
    voided: -1), hits that keep one draft (1)."""
    payoff = AnchorPayoff(min_gain=0.5)
    for _ in range(300):
        for gain in (0, 1, -1):
            payoff.note(gain)
    assert abs(payoff.mean_gain) < 0.2
    assert sum(allowed_in_steps(payoff, 40, 1)) < 40
