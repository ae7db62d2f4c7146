"""What anchored proposals teach the engine (guided/drafts.py): the running payoff that decides
whether drafts are anchored on an in-flight sample."""
from __future__ import annotations

from guided.drafts import AnchorPayoff


def test_payoff_stops_anchoring_after_misses_but_still_probes():
    payoff = AnchorPayoff(min_gain=0.5, probe_every=8)
    assert payoff.allows()  # tried first
    for _ in range(200):
        payoff.note(-1)
    assert payoff.mean_gain < 0.5
    allowed = sum(payoff.allows() for _ in range(800))
    assert 60 <= allowed <= 140  # about one in probe_every, to see again


def test_payoff_recovers_when_anchored_drafts_are_kept_again():
    payoff = AnchorPayoff(min_gain=0.5)
    for _ in range(200):
        payoff.note(-1)
    assert not all(payoff.allows() for _ in range(8))
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
    assert not all(payoff.allows() for _ in range(8))
