"""Scheduling decisions as pure functions of plain numbers: admission, chunking, preemption."""
from __future__ import annotations

from collections.abc import Sequence

# admission reserves KV room for up to this many future tokens per running request (LightLLM's
# peak estimate); max_tokens is often a loose bound, so the horizon caps it
ADMISSION_LOOKAHEAD_TOKENS = 1024


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


def joins_while_in_flight(*, needs_history: bool, tokens_left: int) -> bool:
    """Overlapped scheduling: whether a request whose previous step is still in flight joins
    this one. It joins on that step's last sample (gathered on the device) and assumes that
    step's drafts are all accepted: forced text keeps being drafted every step, anchored on the
    in-flight sample (see Scheduler.settle_in_flight for what a wrong guess costs: one step of
    that request). It waits when the assumed tokens already reach its limit, or when its
    penalties need the in-flight tokens themselves."""
    return tokens_left > 0 and not needs_history
