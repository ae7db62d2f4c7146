"""CUDA-graph decode equals the eager forward pass (GPU only)."""
from __future__ import annotations

import pytest
import torch

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine import Engine

pytestmark = pytest.mark.gpu


def test_graph_replay_matches_eager_decode():
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=16,
                                 max_model_len=1024, num_kv_blocks=256))
    runner = engine.runner
    assert runner.graphs is not None
    prompts = [[(7 * i + j) % 1000 + 100 for j in range(20 + 9 * i)] for i in range(5)]
    for i, p in enumerate(prompts):  # 5 rows: replayed in the padded graph of 8
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0,
                                                      ignore_eos=True))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    sched = engine.scheduler.schedule()
    assert all(it.num_new_tokens == 1 for it in sched.scheduled)
    inputs = runner.prepare(sched, [False] * len(sched.scheduled))
    key = runner.graphs.pick(inputs.meta, inputs.input_ids.shape[0])
    assert key == ("decode", 8)
    with torch.inference_mode():
        graph_out = runner.graphs.run(key, inputs.input_ids, inputs.positions, inputs.meta,
                                      inputs.query_lens).clone()
        eager_out = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                 inputs.meta)
    err = (graph_out.float() - eager_out.float()).norm() / eager_out.float().norm()
    assert err < 2e-2, err
    engine.shutdown()


def test_verify_graph_matches_eager_with_drafts():
    """A step whose requests carry 1..8 tokens (jump-forward drafts) replays a verify graph
    that equals the eager forward pass."""
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=16,
                                 max_model_len=1024, num_kv_blocks=256))
    runner = engine.runner
    prompts = [[(5 * i + j) % 900 + 100 for j in range(30 + 7 * i)] for i in range(5)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0,
                                                      ignore_eos=True))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for i, request in enumerate(engine.requests.values()):
        request.draft_token_ids = [300 + i + j for j in range(i + 2)]  # 2..6 drafts
    sched = engine.scheduler.schedule()
    assert max(it.num_draft_tokens for it in sched.scheduled) == 6
    inputs = runner.prepare(sched, [False] * len(sched.scheduled))
    key = runner.graphs.pick(inputs.meta, inputs.input_ids.shape[0])
    assert key is not None and key[0] == "verify"
    with torch.inference_mode():
        graph_out = runner.graphs.run(key, inputs.input_ids, inputs.positions, inputs.meta,
                                      inputs.query_lens).clone()
        eager_out = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                 inputs.meta)
    err = (graph_out.float() - eager_out.float()).norm() / eager_out.float().norm()
    assert err < 2e-2, err
    engine.shutdown()
