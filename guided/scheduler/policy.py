"""Scheduling decisions as pure functions of plain numbers: admission, chunking, preemption."""
from __future__ import annotations

from collections.abc import Sequence

# admission reserves KV room for up to this many future tokens per running request (LightLLM's
# peak estimate); max_tokens is often a loose bound, so the horizon caps it
ADMISSION_LOOKAHEAD_TOKENS = 1024


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
    set with it fits the cache: admitting what must later be preempted is thrashing. With
    nothing running a request whose prompt fits is always admitted, so progress is guaranteed.
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


def expected_remaining(max_tokens: int, num_output: int, *, cap: int) -> int:
    """Tokens a request may still generate, for the peak estimate (capped: max_tokens is often
    a loose bound)."""
    return max(0, min(max_tokens - num_output, cap))


def lookup_cooldown(consecutive_misses: int) -> int:
    """Proposals to skip prompt-lookup after its drafts missed this many times in a row
    (1, 2, 4, ... up to 32): a request whose output does not repeat stops paying for
    verifying guesses, and one that starts repeating is found again soon."""
    if consecutive_misses <= 0:
        return 0
    return min(32, 1 << min(consecutive_misses - 1, 16))


def joins_while_in_flight(*, needs_history: bool, tokens_left: int) -> bool:
    """Overlapped scheduling: whether a request whose previous step is still in flight joins
    this one, on that step's last sample, assuming its drafts all accepted. It waits when the
    assumed tokens already reach its limit, or when its penalties need the in-flight tokens."""
    return tokens_left > 0 and not needs_history
