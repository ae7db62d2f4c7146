"""CUDA-graph replays equal the eager forward pass (GPU only)."""
from __future__ import annotations

import pytest
import torch

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine
from guided.scheduler.output import build_output

pytestmark = pytest.mark.gpu


def running_engine(prompts: list[list[int]]) -> Engine:
    """An engine on synthetic:llama-3.2-1b whose requests are all past their prefill, stepping
    synchronously (these tests schedule and run steps by hand)."""
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=16,
                                 max_model_len=1024, num_kv_blocks=256, async_scheduling=False))
    assert engine.runner.graphs is not None
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0,
                                                      ignore_eos=True))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    return engine


def graph_vs_eager(engine: Engine, expected_kind: str) -> float:
    runner = engine.runner
    out, _ = build_output(engine.scheduler.schedule(), block_size=engine.config.block_size)
    inputs = runner.prepare(out)
    key = runner.graphs.pick(inputs.meta, inputs.input_ids.shape[0], has_drafts=out.has_drafts)
    assert key is not None and key[0] == expected_kind
    with torch.inference_mode():
        graph_out = runner.graphs.run(key, inputs.input_ids, inputs.positions,
                                      inputs.meta).clone()
        # the graphs hold the fused (compiled) elementwise ops: compare like with like
        eager_out = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                 inputs.meta, fused=True)
    engine.shutdown()
    return float((graph_out.float() - eager_out.float()).norm() / eager_out.float().norm())


def test_decode_graph_matches_eager():
    # 5 rows: replayed in the padded graph of 8
    engine = running_engine([[(7 * i + j) % 1000 + 100 for j in range(20 + 9 * i)]
                             for i in range(5)])
    assert graph_vs_eager(engine, "decode") < 2e-2


def test_verify_graph_matches_eager_with_drafts():
    """A step whose requests carry 1..8 tokens (jump-forward drafts) replays a verify graph."""
    engine = running_engine([[(5 * i + j) % 900 + 100 for j in range(30 + 7 * i)]
                             for i in range(5)])
    for i, request in enumerate(engine.requests.values()):
        request.draft_token_ids = [300 + i + j for j in range(i + 2)]  # 2..6 drafts
    assert graph_vs_eager(engine, "verify") < 2e-2


def test_prefill_graph_matches_eager():
    """Whole prompts (one step, no request past its prefill) replay a prefill graph."""
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=16,
                                 max_model_len=1024, num_kv_blocks=256, async_scheduling=False))
    for i in range(3):
        engine.add_request(f"r{i}", [(13 * i + j) % 900 + 100 for j in range(40 + 61 * i)],
                           SamplingParams(max_tokens=4, temperature=0))
    assert graph_vs_eager(engine, "prefill") < 2e-2


def test_prefill_graph_matches_eager_beside_decoding_requests():
    """A prompt arriving while others decode (continuous batching): one mixed step, replayed."""
    engine = running_engine([[(9 * i + j) % 800 + 100 for j in range(21 + 4 * i)]
                             for i in range(4)])
    engine.add_request("late", [(j * 7) % 900 + 100 for j in range(300)],
                       SamplingParams(max_tokens=4, temperature=0))
    assert graph_vs_eager(engine, "prefill") < 2e-2


def test_arrivals_under_continuous_batching_launch_no_eager_step():
    """Prompts arriving every step (mixed steps) all replay graphs and run to completion. With
    256 sequences a prefill graph has fewer tokens than the batch has request slots."""
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=256,
                                 max_model_len=1024, num_kv_blocks=256))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    done: dict[str, list[int]] = {}
    for i in range(6):
        engine.add_request(f"r{i}", [(17 * i + j) % 900 + 100 for j in range(30 + 50 * i)],
                           params)
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    counts = engine.runner.times.counts
    engine.shutdown()
    assert sorted(done) == [f"r{i}" for i in range(6)]
    assert all(len(ids) == 12 for ids in done.values())
    assert counts["graph_prefill"] >= 3 and counts["eager"] == 0


def test_decode_after_verify_keeps_its_query_offsets():
    """Verify replays rewrite query offsets; a decode replay after one must not read them."""
    engine = running_engine([[(3 * i + j) % 800 + 100 for j in range(25 + 5 * i)]
                             for i in range(4)])
    for request in engine.requests.values():
        request.draft_token_ids = [400, 401, 402]
    engine.step()  # a verify replay
    for request in engine.requests.values():
        request.draft_token_ids = []
    assert graph_vs_eager(engine, "decode") < 2e-2


