"""worker/prompt_logprobs.py, through the engine on the real default model (fp32, CPU): each
prompt token's logprob, rank and top-k equal a torch log_softmax over transformers' logits for
the whole prompt, in one prefill chunk or several, with its prefix in the cache or not, and
through preemption."""
from __future__ import annotations

import pytest
import torch

from guided import LLM, SamplingParams
from guided.scheduler import policy
from guided.scheduler.output import PromptLogprobSpan
from guided.worker.loader import resolve_model_dir
from guided.worker.model_config import synthetic_config
from guided.worker.models.llama import build_model
from guided.worker.models.weights import RandomWeights
from guided.worker.prompt_logprobs import prompt_logprobs

SHORT = "The capital of France is Paris, and the capital of Italy is"
LONG = ("A lighthouse stood alone on the rocky coast. Every night its keeper climbed the stairs, "
        "lit the lamp and watched the ships pass far away on the dark water, counting them.")
TOL = 2e-3


@pytest.fixture(scope="module")
def llm(one_torch_thread) -> LLM:
    # 16-token steps: LONG's prompt runs in several prefill chunks, SHORT's in one
    return LLM(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype="float32")


@pytest.fixture(scope="module")
def reference(llm) -> dict[str, tuple[list[int], torch.Tensor]]:
    """prompt -> (its ids, (P, V) log_softmax of transformers' logits at every position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("default")),
                                                 dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for text in (SHORT, LONG):
            ids = llm.tokenizer.encode(text)
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            out[text] = ids, torch.log_softmax(logits.float(), dim=-1)
    return out


def assert_matches(entries, ids: list[int], ref: torch.Tensor, num_top: int,
                   tol: float = TOL) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        e, row = entries[pos], ref[pos - 1]  # position pos - 1 predicts token pos
        expected = float(row[ids[pos]])
        assert e.token_id == ids[pos]
        assert e.logprob == pytest.approx(expected, abs=tol)
        # ranks counted against the reference, allowing for near ties within the tolerance
        assert (row > expected + tol).sum() + 1 <= e.rank <= (row > expected - tol).sum() + 1
        assert len(e.top) == num_top
        top = row.topk(num_top)
        assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=tol)
        assert [t for t, _ in e.top][:1] == top.indices.tolist()[:1]


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["one_chunk", "chunked"])
def test_prompt_logprobs_equal_log_softmax_over_the_models_logits(llm, reference, text):
    ids, ref = reference[text]
    assert (len(ids) > 16) == (text == LONG)
    out = llm.generate(text, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert_matches(out.prompt_logprobs, ids, ref, 3)
    assert len(out.token_ids) == 2 and out.logprobs is None


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(llm, reference):
    ids, ref = reference[LONG]
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(LONG, plain)  # its full blocks enter the prefix cache
    assert llm.generate(LONG, plain)[0].metrics.prefix_cache_hit_tokens >= 16
    queries = llm.engine.stats().prefix_cache_queries_total
    out = llm.generate(LONG, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.metrics.prefix_cache_hit_tokens == 0  # hidden states of every position needed
    assert llm.engine.stats().prefix_cache_queries_total == queries  # no lookup counted
    assert_matches(out.prompt_logprobs, ids, ref, 0)


def test_only_the_rows_that_ask_get_them_in_a_mixed_batch(llm, reference):
    ids, ref = reference[LONG]
    asks = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([SHORT, LONG, LONG], [plain, asks, plain])
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert_matches(outs[1].prompt_logprobs, ids, ref, 1)
    assert outs[1].token_ids == outs[2].token_ids  # asking changes nothing of the output
    one_token = llm.tokenizer.encode("Hi")[:1]
    assert llm.generate([one_token], asks)[0].prompt_logprobs == [None]


def test_max_tokens_0_scores_the_prompt_alone(llm, reference):
    ids, ref = reference[SHORT]
    out = llm.generate(SHORT, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert_matches(out.prompt_logprobs, ids, ref, 2)
    assert llm.generate(SHORT, SamplingParams(max_tokens=0))[0].metrics.forward_passes == 0
    assert llm.engine.stats().kv_blocks_in_use == 0


def test_spans_of_several_rows_split_back_in_order():
    cfg = synthetic_config("tiny")
    model = build_model(cfg, RandomWeights(0), device=torch.device("cpu"), dtype=torch.float32)
    hidden = torch.randn(10, cfg.hidden_size)  # (T, H)
    spans = [PromptLogprobSpan(0, [5, 6, 7], 2), PromptLogprobSpan(6, [1, 2], 0)]
    got = prompt_logprobs(model, hidden, spans).result()
    lps = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # (T, V)
    for span, out in zip(spans, got):
        rows = lps[span.token_start:span.token_start + len(span.target_ids)]
        targets = torch.tensor(span.target_ids)
        assert out.logprobs == pytest.approx(rows.gather(1, targets[:, None])[:, 0].tolist())
        assert out.ranks == [int((r > r[t]).sum()) + 1 for r, t in zip(rows, targets)]
        assert out.top_ids == rows.topk(span.num_top).indices.tolist()
        torch.testing.assert_close(torch.tensor(out.top_logprobs).reshape(len(rows), -1),
                                   rows.topk(span.num_top).values)


def test_preempted_requests_keep_complete_prompt_logprobs(reference, monkeypatch):
    monkeypatch.setattr(policy, "ADMISSION_LOOKAHEAD_TOKENS", 0)  # admit greedily: preempt
    ids, ref = reference[LONG]
    # two prompts' blocks and a spare: both grow past them while they decode
    llm = LLM(num_kv_blocks=2 * -(-len(ids) // 16) + 2, enable_prefix_caching=False,
              max_num_batched_tokens=16, dtype="float32")
    asks = SamplingParams(max_tokens=40, temperature=0, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([LONG] * 3, asks)
    assert llm.engine.stats().preemptions_total > 0, "the KV budget was meant to force preemption"
    for out in outs:
        assert_matches(out.prompt_logprobs, ids, ref, 1)
    assert llm.engine.stats().kv_blocks_in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_on_the_gpu_with_and_without_cuda_graphs(reference, cuda_graphs):
    """16-token steps: each prefill chunk runs in the 16-token prefill graph (or eagerly), its
    prompt logprobs computed from the graph's hidden states outside it."""
    ids, ref = reference[LONG]
    llm = LLM(device="cuda", dtype="float32", cuda_graphs=cuda_graphs, num_kv_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=16)
    try:
        out = llm.generate(LONG, SamplingParams(max_tokens=2, temperature=0,
                                                prompt_logprobs=2))[0]
        assert_matches(out.prompt_logprobs, ids, ref, 2, tol=1e-2)
        if cuda_graphs:
            assert llm.engine.step_times.counts["graph_prefill"] > 0
    finally:
        llm.engine.shutdown()
