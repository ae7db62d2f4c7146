"""The pure scheduling decisions, on plain numbers."""
from guided.scheduler import policy


def test_num_tokens_to_schedule_chunks_long_prefills():
    assert policy.num_tokens_to_schedule(10, 100) == 10
    assert policy.num_tokens_to_schedule(300, 100) == 100
    assert policy.num_tokens_to_schedule(300, 100, chunked_prefill=False) == 0


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


def test_preemption_victim_is_the_latest_arrival():
    assert policy.pick_preemption_victim([3, 9, 1]) == 1


def test_expected_remaining_is_capped():
    assert policy.expected_remaining(100, 30, cap=1000) == 70
    assert policy.expected_remaining(10**6, 0, cap=1000) == 1000
    assert policy.expected_remaining(5, 9, cap=1000) == 0


def test_lookup_cooldown_doubles_and_is_capped():
    assert policy.lookup_cooldown(0) == 0
    assert [policy.lookup_cooldown(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert policy.lookup_cooldown(40) == 32
    assert policy.lookup_cooldown(40, max_cooldown=8) == 8


def test_multi_step_calls_wait_for_late_rows_only_in_small_batches():
    assert policy.waits_for_late_rows(1) and policy.waits_for_late_rows(16)
    assert not policy.waits_for_late_rows(17) and not policy.waits_for_late_rows(256)
    assert policy.waits_for_late_rows(40, max_batch=64)


def test_num_decode_steps():
    assert policy.num_decode_steps(8, all_plain_decode=True, tokens_left=[20, 5]) == 5
    assert policy.num_decode_steps(8, all_plain_decode=True, tokens_left=[20, 30]) == 8
    assert policy.num_decode_steps(8, all_plain_decode=False, tokens_left=[20]) == 1
    assert policy.num_decode_steps(1, all_plain_decode=True, tokens_left=[20]) == 1
    assert policy.num_decode_steps(8, all_plain_decode=True, tokens_left=[]) == 1


def test_joins_while_in_flight():
    assert policy.joins_while_in_flight(needs_history=False, tokens_left=3)
    assert not policy.joins_while_in_flight(needs_history=True, tokens_left=3)
    assert not policy.joins_while_in_flight(needs_history=False, tokens_left=0)


def test_lookup_drafts_only_up_to_the_batch_limit():
    assert policy.drafts_lookup(128, max_batch=128)
    assert not policy.drafts_lookup(129, max_batch=128)
    assert policy.drafts_lookup(10_000, max_batch=None)
    assert not policy.drafts_lookup(1, max_batch=0)


def test_anchoring_pays_from_the_mean_gain_up():
    assert policy.anchoring_pays(0.5, min_gain=0.5)
    assert not policy.anchoring_pays(0.1, min_gain=0.5)
    assert policy.anchoring_pays(-1.0, min_gain=-2.0)


def test_samples_unmasked_only_in_wide_states_without_forced_text_or_filters():
    assert policy.samples_unmasked(wide=True, num_forced_drafts=0, greedy=False, filtered=False)
    assert not policy.samples_unmasked(wide=False, num_forced_drafts=0, greedy=True,
                                       filtered=False)
    assert not policy.samples_unmasked(wide=True, num_forced_drafts=2, greedy=True,
                                       filtered=False)
    # top-k / top-p / min-p cut the masked distribution; greedy keeps the argmax anyway
    assert not policy.samples_unmasked(wide=True, num_forced_drafts=0, greedy=False,
                                       filtered=True)
    assert policy.samples_unmasked(wide=True, num_forced_drafts=0, greedy=True, filtered=True)


def test_lazy_masks_pay_only_while_the_host_bounds_the_step():
    assert policy.lazy_masks_pay(device_wait_ms=0.1, fill_ms=3.0)
    assert not policy.lazy_masks_pay(device_wait_ms=3.0, fill_ms=1.0)
    # the host waits on the device: its fill is hidden already, whatever it costs
    assert not policy.lazy_masks_pay(device_wait_ms=2.0, fill_ms=3.0)
    assert not policy.lazy_masks_pay(device_wait_ms=0.1, fill_ms=0.05)  # nothing to save


def test_mask_shards_by_default_only_for_small_models_overlapped_on_a_gpu_of_a_roomy_host():
    def shards(overlapped=True, on_gpu=True, num_cpus=16, num_params=135_000_000):
        return policy.default_mask_processes(overlapped=overlapped, on_gpu=on_gpu,
                                             num_cpus=num_cpus, num_params=num_params)

    assert shards() == 4
    assert shards(num_cpus=8) == 4 and shards(num_cpus=7) == 0
    assert shards(num_params=999_999_999) == 4 and shards(num_params=1_000_000_000) == 0
    assert shards(num_params=8_000_000_000) == 0
    assert shards(overlapped=False) == 0
    assert shards(on_gpu=False) == 0  # overlapped steps on the CPU (tests) fill in-process


def test_schema_workers_by_default_only_on_a_gpu_of_a_roomy_host():
    assert policy.default_schema_processes(on_gpu=True, num_cpus=16) == 4
    assert policy.default_schema_processes(on_gpu=True, num_cpus=8) == 4
    assert policy.default_schema_processes(on_gpu=True, num_cpus=7) == 0
    assert policy.default_schema_processes(on_gpu=False, num_cpus=64) == 0  # CPU: in-thread


def test_idle_class_compiles_by_default_only_on_a_gpu_of_a_roomy_host():
    assert policy.default_compile_sched_idle(on_gpu=True, num_cpus=16)
    assert not policy.default_compile_sched_idle(on_gpu=True, num_cpus=4)
    assert not policy.default_compile_sched_idle(on_gpu=False, num_cpus=64)  # CPU: would starve


def test_compile_threads_by_default_take_idle_cores_only_where_they_are_idle_class():
    assert policy.default_compile_threads(sched_idle=True, num_cpus=16) == 12
    assert policy.default_compile_threads(sched_idle=True, num_cpus=4) == 4
    assert policy.default_compile_threads(sched_idle=False, num_cpus=64) == 4


def test_one_xgrammar_compile_spreads_over_idle_cores_only_where_compiles_are_idle_class():
    assert policy.default_xgrammar_threads(sched_idle=True, num_cpus=16) == 8
    assert policy.default_xgrammar_threads(sched_idle=True, num_cpus=6) == 3
    assert policy.default_xgrammar_threads(sched_idle=False, num_cpus=64) == 1


def test_resolve_compile_config_fills_only_what_the_config_leaves_open():
    from guided.config import EngineConfig

    gpu = policy.resolve_compile_config(EngineConfig(), on_gpu=True, num_cpus=16)
    assert (gpu.compile_sched_idle, gpu.compile_threads, gpu.schema_processes,
            gpu.xgrammar_threads, gpu.dfa_max_wait_size) == (True, 12, 4, 8, 0)
    cpu = policy.resolve_compile_config(EngineConfig(), on_gpu=False, num_cpus=16)
    assert (cpu.compile_sched_idle, cpu.compile_threads, cpu.schema_processes,
            cpu.xgrammar_threads, cpu.dfa_max_wait_size) == (False, 4, 0, 1, 1000)
    mine = policy.resolve_compile_config(
        EngineConfig(compile_threads=3, compile_sched_idle=False, xgrammar_threads=2),
        on_gpu=True, num_cpus=16)
    assert (mine.compile_sched_idle, mine.compile_threads, mine.xgrammar_threads) == (False, 3, 2)
