"""Multi-step decode calls (num_scheduler_steps > 1): num_steps decode steps of a decode batch
(no drafts, penalties or logprobs) without scheduling between them, each step's sampled tokens
the next step's inputs on the device. A constrained row whose mask is late (a heavy row,
fsm/decode_masks.py) sits the step out: the next step feeds it the same token at the same
position, and its sample there is dropped.

Without constrained requests the host reads all tokens once at the end. With them it reads
each step's tokens while the device runs the next forward pass, and the matchers take them and
fill that step's mask rows meanwhile (fsm/decode_masks.py), but for the rows of DFA grammars,
which the device masks and moves on itself (device_dfa.py, kernels/dfa_advance.py): with only
those the host waits for nothing between steps. The blocks for every step must be allocated.
A request that finishes early (EOS, stop string, its grammar's end) has its later tokens
dropped by the engine."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from guided.fsm.decode_masks import DecodeStepMasks
from guided.kernels.bitmask import masked_sample
from guided.kernels.decode_inputs import advance_decode_inputs_
from guided.kernels.dfa_advance import dfa_advance
from guided.scheduler.policy import waits_for_late_rows
from guided.scheduler.scheduler import SchedulerOutput
from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.device_dfa import DeviceDfa
from guided.worker.host_lists import list_later, list_tensor
from guided.worker.sampler import position_seed
from guided.worker.step_io import RunnerOutput, StepInputs

if TYPE_CHECKING:
    from guided.worker.model_runner import ModelRunner


class DecodeSteps:
    """A runner's multi-step calls, and the device table of its DFA grammars (made for the
    first one stepped there)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device_dfa: DeviceDfa | None = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, num_steps: int) -> RunnerOutput:
        runner = self.runner
        times = runner.times
        with times.phase("prepare"):
            inputs = runner.prepare(sched, [item.masked for item in sched.scheduled])
            dev = runner.device
            seeds = list_tensor(
                [[position_seed(item.request.seed, len(item.request.output_token_ids) + k)
                  for item in sched.scheduled] for k in range(num_steps)],
                torch.int64).to(dev, non_blocking=True)  # (S, B)
            temperature = list_tensor(inputs.rows.temperature, torch.float32).to(
                dev, non_blocking=True)
        with times.phase("prepare_grammar"):
            grammar = mask_rows = table = advance = None
            if inputs.num_mask_rows:
                on_device = self._device_rows(sched, inputs.mask_rows)
                grammar = DecodeStepMasks(sched, inputs.mask_rows, device_rows=on_device,
                                          num_threads=runner.config.mask_threads)
                if on_device:  # mask_rows: each row's state, moved after every sample
                    table, advance = self.device_dfa, self.device_dfa.tables
                    times.count("mask_rows_device", len(on_device) * num_steps)
                    rows = [on_device.get(b, -1 if r < 0 else 1 + r)
                            for b, r in enumerate(grammar.host_rows)]
                else:
                    rows = inputs.mask_rows
                mask_rows = list_tensor(rows, torch.int32).to(dev, non_blocking=True)
        step_inputs = _StepInputs(runner, inputs)
        wait_late = waits_for_late_rows(len(sched.scheduled))
        steps: list[torch.Tensor] = []
        previous: Callable[[], list[int]] | None = None  # the last step's ids, on their way
        late_at: list[frozenset[int]] = []  # each step's late rows: their samples do not count
        moves: torch.Tensor | None = None  # the last step's: 1 a row that moved on, 0 a late one
        lag: torch.Tensor | None = None  # steps each row sat out so far (None: none did)
        with times.phase("forward_launch"):
            for k in range(num_steps):
                # between the last sample and this forward pass only launches that must be
                # there (the host is often just in time for the sample: see _StepInputs)
                runner.timeline.mark("forward")
                hidden = step_inputs.forward(k, None if k == 0 else steps[-1], moves)
                logits = runner.model.compute_logits(hidden)
                runner.timeline.mark("decode end")
                if table is not None and k:  # each DFA row's state after its last sample
                    mask_rows = dfa_advance(mask_rows, steps[-1], advance, eos=table.eos)
                if table is not None and previous is not None:  # while the forward pass runs
                    with times.phase("device_rows_accept"):
                        grammar.accept(previous(), device=True)
                bitmask, late = None, frozenset()
                if grammar is not None and grammar.num_rows:  # the host's part, meanwhile
                    done = None if wait_late else runner._mark_forward_done()
                    with times.phase("mask_fill"):
                        host = runner.new_bitmask(grammar.num_rows)
                        late = grammar.fill(None if previous is None else previous(), host,
                                            give_up=None if done is None else done.query)
                    with times.phase("mask_upload"):  # with a table: below its DFA rows
                        bitmask = runner._bitmasks.to_device(
                            host, None if table is None else table.rows[1:1 + grammar.num_rows])
                if table is not None:
                    bitmask = table.rows
                # a row's k-th sample of the call is seeded as its k-th token, late steps or not
                seed = seeds[k] if lag is None else seeds.gather(0, (k - lag).unsqueeze(0))[0]
                runner.timeline.mark("sample")
                steps.append(masked_sample(logits, bitmask, mask_rows, temperature, seed,
                                           vocab_size=runner.vocab_size))
                runner.timeline.mark("sample end")
                if grammar is not None:  # queued before the next forward pass, not after it
                    previous = list_later(steps[-1])
                late_at.append(late)
                moves = None
                if late:
                    times.count("late_steps", len(late))
                    moves = list_tensor([int(b not in late) for b in range(len(sched.scheduled))],
                                        torch.int64).to(dev, non_blocking=True)
                    lag = (1 - moves) if lag is None else lag + (1 - moves)
        with times.phase("sample_and_sync"):
            tokens = torch.stack(steps, dim=1).tolist()  # (B, S): the one device -> host copy
        if grammar is None:
            return RunnerOutput(tokens, [[None] * num_steps for _ in tokens])
        with times.phase("accept_last"):
            for k in range(grammar.host_steps_accepted, num_steps):  # each step's, in order
                grammar.accept([row[k] for row in tokens], device=False)
            for k in range(grammar.device_steps_accepted, num_steps):
                grammar.accept([row[k] for row in tokens], device=True)
        for b in set().union(*late_at):  # a late row's samples at its late steps are dropped
            tokens[b] = [t for t, late in zip(tokens[b], late_at) if b not in late]
        return RunnerOutput(tokens, [[None] * len(row) for row in tokens],
                            accepted=grammar.accepted_rows)

    def _device_rows(self, sched: SchedulerOutput, mask_rows: list[int]) -> dict[int, int]:
        """The constrained rows of a multi-step call the device masks and steps (scheduled
        index -> its state's row in the DeviceDfa table): those on a DFA whose tables are
        built (and fit)."""
        config = self.runner.config
        if not config.device_dfa:
            return {}
        out = {}
        for b, (item, row) in enumerate(zip(sched.scheduled, mask_rows)):
            matcher = item.request.matcher
            dfa = getattr(matcher, "dfa", None)
            if row < 0 or dfa is None or dfa.tables is None or matcher.is_terminated():
                continue
            if self.device_dfa is None:
                if dfa.vocab.num_words != self.runner.mask_words:  # not this model's vocabulary
                    continue
                self.device_dfa = DeviceDfa(
                    self.runner.mask_words, self.runner.device, host_rows=config.max_num_seqs,
                    max_rows=config.device_dfa_max_rows,
                    max_exceptions=config.device_dfa_max_exceptions, eos=dfa.vocab.eos_id)
            state_row = self.device_dfa.row_of(dfa, matcher.state)
            if state_row is not None:
                out[b] = state_row
        return out


class _StepInputs:
    """A multi-step call's decode inputs, advanced in place from each step's samples by one
    kernel (guided/kernels/decode_inputs.py): in the decode graph's own input buffers where a
    graph runs the batch (the later steps replay it, nothing copied), else in copies of the
    first step's. When the host fills masks until the forward pass ends, the device waits for
    every launch between a step's sample and the next forward pass; built from torch ops and a
    graph's input copies those were ~25 a step."""

    def __init__(self, runner: ModelRunner, inputs: StepInputs):
        self.runner, self.inputs = runner, inputs
        meta, graphs = inputs.meta, runner.graphs
        self.num_rows = inputs.input_ids.shape[0]
        self.key = None if graphs is None else graphs.pick(meta, self.num_rows, has_drafts=False)
        if self.key is not None and self.key[0] == "decode":
            self.buffers = (graphs.input_ids, graphs.positions, graphs.seq_lens,
                            graphs.slot_mapping, graphs.block_tables)
        else:
            self.key = None
            self.buffers = (inputs.input_ids.clone(), inputs.positions.clone(),
                            meta.seq_lens.clone(), meta.slot_mapping.clone(), meta.block_tables)

    def forward(self, k: int, sampled: torch.Tensor | None, moves: torch.Tensor | None
                ) -> torch.Tensor:
        """Step k's hidden states: the call's first inputs at k = 0, then each row's sample
        at its next position (moves: 0 for a row that sits the step out)."""
        runner = self.runner
        if k == 0:
            return runner._forward(self.inputs)[0]
        ids, positions, seq_lens, slots, tables = self.buffers
        advance_decode_inputs_(ids, positions, seq_lens, slots, tables, sampled, moves,
                               block_size=runner.block_size)
        if self.key is not None:
            runner.times.count("graph_decode")
            return runner.graphs.replay(self.key, self.num_rows)
        runner.times.count("eager")
        meta, b = self.inputs.meta, self.num_rows
        meta = AttentionMetadata(
            slot_mapping=slots[:b], block_tables=tables, query_start_loc=meta.query_start_loc,
            seq_lens=seq_lens[:b], max_query_len=1, max_seq_len=meta.max_seq_len + k,
            use_triton=meta.use_triton)
        return runner.model(ids[:b], positions[:b], runner.kv_caches, meta)
