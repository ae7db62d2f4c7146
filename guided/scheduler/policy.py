"""Scheduling decisions as pure functions of plain numbers: admission, chunking, preemption."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def num_tokens_to_schedule(num_pending: int, token_budget: int, *, chunked_prefill: bool = True
                           ) -> int:
    """How many of a request's pending tokens fit this step (0: wait for the next)."""
    if num_pending <= token_budget:
        return num_pending
    return token_budget if chunked_prefill else 0


def peak_blocks(current_tokens: Sequence[int], remaining_tokens: Sequence[int],
                block_size: int) -> int:
    """LightLLM's estimate of the peak KV blocks a set of running requests will hold.

    If request i holds c_i tokens and may generate r_i more, sort by r ascending; when request k
    finishes (after r_k more steps) every request still alive has grown by r_k, so

        peak = max_k  sum_{j >= k} (c_j + r_k)   (in blocks, each request rounding up)

    Admitting a request keeps this under the cache size, so it never needs preempting (given
    honest max_tokens); a request that stops early only frees room sooner.
    """
    order = sorted(range(len(current_tokens)), key=lambda i: remaining_tokens[i])
    # suffix sums make it O(n log n); ceil((c + r) / bs) <= (c + r) / bs + 1 keeps it an upper bound
    peak = 0.0
    suffix_tokens = 0
    for n_alive, k in enumerate(reversed(order), start=1):
        suffix_tokens += current_tokens[k]
        r = remaining_tokens[k]
        peak = max(peak, (suffix_tokens + n_alive * r) / block_size + n_alive)
    return int(peak)


def can_admit(*, prompt_blocks_needed: int, num_free_blocks: int, num_total_blocks: int,
              running_current: Sequence[int], running_remaining: Sequence[int],
              new_current: int, new_remaining: int, block_size: int,
              watermark_blocks: int) -> bool:
    """Admit a waiting request only if its prompt fits now and the estimated peak of the running
    set with it fits the cache: admitting what must later be preempted is thrashing.

    With nothing running the request is always admitted if its prompt fits, so progress is
    guaranteed; the estimate is capped by each request's remaining budget.
    """
    if prompt_blocks_needed > num_free_blocks:
        return False
    if not running_current:
        return True
    if num_free_blocks - prompt_blocks_needed < watermark_blocks:
        return False
    peak = peak_blocks(list(running_current) + [new_current],
                       list(running_remaining) + [new_remaining], block_size)
    return peak <= num_total_blocks


def pick_preemption_victim(arrival_order: Sequence[int]) -> int:
    """Index of the request to preempt: the latest arrival (it has the least work to redo and
    the earliest requests keep their latency)."""
    if not arrival_order:
        raise ValueError("nothing to preempt")
    return max(range(len(arrival_order)), key=lambda i: arrival_order[i])


def expected_remaining(max_tokens: int, num_output: int, *, cap: int) -> int:
    """Tokens a request may still generate, for the peak estimate; capped because max_tokens is
    often a loose bound (the cap is the scheduler's horizon)."""
    return max(0, min(max_tokens - num_output, cap))


def waits_for_late_rows(num_running: int, *, max_batch: int = 16) -> bool:
    """Whether a multi-step call waits for a heavy row's mask (fsm/decode_masks.py) rather than
    stop its request for the rest of the call once the device is done with the step. Stopping
    spares the batch the wait but costs that request up to the call's remaining steps; in a
    small batch (the tail of a wave, where the heavy requests are what is left) those tokens
    are the batch's work, and the wait holds up few others: the default model at 256 spent 16%
    of a wave's time in calls of 1-16 requests while its heavy rows stopped, against 5% without
    grammars (RESULTS, session 26)."""
    return num_running <= max_batch


def num_decode_steps(max_steps: int, *, all_plain_decode: bool, tokens_left: Sequence[int]
                     ) -> int:
    """How many decode steps to run back to back on the device before the host looks again.

    Only a batch of plain decodes qualifies (one new token each, no drafts, penalties or
    logprobs: nothing the host must do between steps but a grammar's accept and mask row,
    which overlap the next forward pass); and never past the request closest to its token
    limit, so no step is spent on a request that must stop."""
    if max_steps <= 1 or not all_plain_decode or not tokens_left:
        return 1
    return max(1, min(max_steps, min(tokens_left)))


def lookup_cooldown(consecutive_misses: int, *, max_cooldown: int = 32) -> int:
    """Proposals to skip prompt-lookup after its drafts missed this many times in a row
    (1, 2, 4, ... up to max_cooldown): a request whose output does not repeat stops paying for
    verifying guesses (on a large model every drafted slot costs compute), and one that starts
    repeating is found again soon."""
    if consecutive_misses <= 0:
        return 0
    return min(max_cooldown, 1 << min(consecutive_misses - 1, 16))


def drafts_lookup(num_running: int, *, max_batch: int | None) -> bool:
    """Whether prompt-lookup guesses are drafted at this batch size. Forced text always is (it
    is never wrong); a guess costs a verify slot, a mask row and its proposal, which past the
    GPU's memory-bound knee (a large batch) a rare hit does not pay back."""
    return max_batch is None or num_running <= max_batch


def anchoring_pays(mean_gain: float, *, min_gain: float) -> bool:
    """Overlapped scheduling: whether drafts anchored on a request's in-flight sample are worth
    making. An anchored proposal gains the drafts it gets accepted when its guess for that
    sample hits, less the request's next step when one of them is rejected (that step, in
    flight, assumed them all: it is voided), and nothing when the guess misses; a model that
    seldom writes the grammar's forced text in the canonical tokens (a random-weights one)
    gains ~0 a proposal and still pays the verify rows, their masks and the proposals."""
    return mean_gain >= min_gain


def samples_unmasked(*, wide: bool, num_forced_drafts: int, greedy: bool,
                     filtered: bool) -> bool:
    """Lazy masks: whether a constrained request's rows this step are sampled without their
    grammar mask (and checked against the grammar afterwards). With Gumbel-max sampling on
    the same noise, an unmasked argmax that the grammar allows is the masked argmax, so an
    allowed sample is the masked sample; a disallowed one costs the request a step or two (the
    position runs again, masked). Worth it where the grammar allows most tokens (wide: its last
    filled row said so), as inside a string, where rows cost the most to fill and a model
    seldom leaves the grammar; not before forced text (a model often writes it in other
    tokens, which the mask would have ruled out), nor under top-k / top-p / min-p, which cut
    the masked distribution, not the unmasked one (unless greedy: the argmax survives them)."""
    return wide and not num_forced_drafts and (greedy or not filtered)


# the host's mean wait for the device's tokens under which it bounds the step (ms): a step's
# host work varies, so a host that waits this little still holds the device up in some steps
HOST_BOUND_WAIT_MS = 0.5


def lazy_masks_pay(*, device_wait_ms: float, fill_ms: float) -> bool:
    """Overlapped scheduling: whether lazy masks are worth it now. They save the host the fill
    of wide rows at the price of a step or two of a request for each sample outside the
    grammar; the saving shows only while the host bounds the step, that is while it hardly
    waits for the device. A host that waits on the device at all has its fill hidden behind
    the forward pass already, and only the misses would remain (a random 8B at 64 on an H100:
    5% slower with them; at 256, waiting 2-3 ms a step, 190 misses cost a run 12 steps of
    256: benchmarks/RESULTS.md, session 21)."""
    return device_wait_ms < min(fill_ms, HOST_BOUND_WAIT_MS)


def joins_while_in_flight(*, needs_history: bool, tokens_left: int) -> bool:
    """Overlapped scheduling: whether a request whose previous step is still in flight joins
    this one. It joins on that step's last sample (gathered on the device) and assumes that
    step's drafts are all accepted: forced text keeps being drafted every step, anchored on the
    in-flight sample (see Scheduler.settle_in_flight for what a wrong guess costs: one step of
    that request). It waits when the assumed tokens already reach its limit, or when its
    penalties need the in-flight tokens themselves."""
    return tokens_left > 0 and not needs_history


def default_mask_processes(*, overlapped: bool, on_gpu: bool, num_cpus: int,
                           num_params: int) -> int:
    """Mask shard processes when the config leaves it open: under overlapped scheduling on a GPU
    for a model whose forward pass is short, so that a step waits on the loop's grammar work, on
    a host with cores to spare beside the loop, the mask threads and the compile threads. The
    bars (1B weights, 8 CPUs) are choices between what was measured (H100 host of 16 CPUs,
    warm grammars, constrained / free): the 135M default model at 64 gained (0.68-0.79 with 4 or
    8 shards, 0.61-0.66 without in the same calls), the random 8B at 256 lost (0.74 against
    0.89), its fills cheap already with lazy masks (benchmarks/RESULTS.md, session 13)."""
    return 4 if overlapped and on_gpu and num_cpus >= 8 and num_params < 1_000_000_000 else 0


def default_schema_processes(*, on_gpu: bool, num_cpus: int) -> int:
    """Schema worker processes when the config leaves it open (fsm/schema_worker.py): where a
    step loop on a GPU shares the GIL with a cold server's compiles, on a host with cores to
    spare. Measured on an H200 host of 16 CPUs, the default model cold at 64 (RESULTS, session
    28): with 4, TPOT p50 9.0-9.1 ms and 3844.8-4277.6 tok/s, without 11.7 ms and 3685.3."""
    return 4 if on_gpu and num_cpus >= 8 else 0


def default_compile_sched_idle(*, on_gpu: bool, num_cpus: int) -> bool:
    """Compiles under SCHED_IDLE when the config leaves it open: where the step loop needs one
    core and the host has many (a GPU host of 8+ CPUs; H200 host of 16, default model cold at
    64, RESULTS session 29: the step loop's wait for a core 0-1% against 5-22%, 3306.5 against
    3060.4 tok/s). On the CPU the model's forward pass keeps every core busy, and idle-class
    compiles would wait for their timeout."""
    return on_gpu and num_cpus >= 8


def default_compile_threads(*, sched_idle: bool, num_cpus: int) -> int:
    """Compile threads when the config leaves it open: where compiles only take idle cores
    (SCHED_IDLE, a GPU host), three quarters of the CPUs; a cold wave of new schemas keeps
    them busy (H200 host of 16 CPUs, default model cold at 64, RESULTS session 29: 6 threads
    3578.1 tok/s with TTFT p50 1302 ms, 8: 3345.0, 12: 4323.7-4795.1, 16: 4386.6). Elsewhere 4,
    beside a forward pass that wants every core."""
    return max(4, num_cpus * 3 // 4) if sched_idle else 4


def default_xgrammar_threads(*, sched_idle: bool, num_cpus: int) -> int:
    """Threads one xgrammar compile spreads over when the config leaves it open: where compiles
    take idle cores only (SCHED_IDLE), up to 8 (half the CPUs), so that a cold wave's few
    large schemas (seconds of a core each: its tail) compile in a fraction of that; elsewhere
    1, beside a forward pass that wants every core."""
    return max(1, min(8, num_cpus // 2)) if sched_idle else 1


def default_dfa_max_wait_size(*, sched_idle: bool) -> int:
    """The regex size up to which a new regular schema's first requests wait for its token-level
    DFA, when the config leaves it open. Where compiles take idle cores (a GPU host) none do:
    xgrammar serves each new schema at once while its DFA builds in the background, because an
    outlines-core index costs ~5x xgrammar's compile of the same schema (median 40 ms against
    6 ms, benchmarks/compile_vs_baseline.py), and in a cold wave those builds were the compile
    threads' time (benchmarks/compile_contention.py under py-spy) and the wave the pass's
    length (H200 host of 16 CPUs, default model, every schema new at 64, RESULTS session 30:
    6510.4 tok/s against 5710.2 waiting up to 1000). Elsewhere 1000: a DFA that builds in
    well under a second is worth its wait where fills are the step loop's."""
    return 0 if sched_idle else 1000


def resolve_compile_config(config, *, on_gpu: bool, num_cpus: int):
    """config with its open compile settings (None) resolved by the defaults above: what the
    grammar compiler runs with."""
    idle = (default_compile_sched_idle(on_gpu=on_gpu, num_cpus=num_cpus)
            if config.compile_sched_idle is None else config.compile_sched_idle)
    return dataclasses.replace(
        config, compile_sched_idle=idle,
        schema_processes=(default_schema_processes(on_gpu=on_gpu, num_cpus=num_cpus)
                          if config.schema_processes is None else config.schema_processes),
        compile_threads=(default_compile_threads(sched_idle=idle, num_cpus=num_cpus)
                         if config.compile_threads is None else config.compile_threads),
        xgrammar_threads=(default_xgrammar_threads(sched_idle=idle, num_cpus=num_cpus)
                          if config.xgrammar_threads is None else config.xgrammar_threads),
        dfa_max_wait_size=(default_dfa_max_wait_size(sched_idle=idle)
                           if config.dfa_max_wait_size is None else config.dfa_max_wait_size))
