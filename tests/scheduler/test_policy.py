"""The pure scheduling decisions, on plain numbers."""
from guided.scheduler import policy


def test_peak_blocks_is_an_upper_bound_of_the_simulated_peak():
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        cur = [rng.randint(1, 300) for _ in range(n)]
        rem = [rng.randint(0, 300) for _ in range(n)]
        bs = 16
        simulated = 0
        for t in range(max(rem) + 1):
            alive = [i for i in range(n) if rem[i] >= t]
            simulated = max(simulated, sum(-(-(cur[i] + t) // bs) for i in alive))
        estimate = policy.peak_blocks(cur, rem, bs)
        assert simulated <= estimate <= simulated + n + 1


def test_can_admit_refuses_what_would_later_need_preemption():
    common = dict(num_total_blocks=100, block_size=16, watermark_blocks=1)
    # one request running that will grow to 80 blocks: a newcomer growing to 40 would not fit
    assert not policy.can_admit(prompt_blocks_needed=2, num_free_blocks=90,
                                running_current=[160], running_remaining=[1120],
                                new_current=32, new_remaining=1000, **common)
    # short outputs fit
    assert policy.can_admit(prompt_blocks_needed=2, num_free_blocks=90,
                            running_current=[160], running_remaining=[16],
                            new_current=32, new_remaining=16, **common)
    # nothing running: admitted whenever the prompt fits (progress is guaranteed)
    assert policy.can_admit(prompt_blocks_needed=90, num_free_blocks=90, running_current=[],
                            running_remaining=[], new_current=1440, new_remaining=10**6, **common)
    assert not policy.can_admit(prompt_blocks_needed=91, num_free_blocks=90, running_current=[],
                                running_remaining=[], new_current=1456, new_remaining=1, **common)


def test_expected_remaining_is_capped():
    assert policy.expected_remaining(100, 30, cap=1000) == 70
    assert policy.expected_remaining(10**6, 0, cap=1000) == 1000
    assert policy.expected_remaining(5, 9, cap=1000) == 0


def test_lookup_cooldown_doubles_and_is_capped():
    assert policy.lookup_cooldown(0) == 0
    assert [policy.lookup_cooldown(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert policy.lookup_cooldown(40) == 32


def test_joins_while_in_flight():
    assert policy.joins_while_in_flight(needs_history=False, tokens_left=3)
    assert not policy.joins_while_in_flight(needs_history=True, tokens_left=3)
    assert not policy.joins_while_in_flight(needs_history=False, tokens_left=0)
