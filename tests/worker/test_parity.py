"""Greedy tokens of our engine equal transformers' on the same weights (fp32, CPU), with prefix
caching on and off, and under a KV budget small enough to force preemption."""
from __future__ import annotations

import pytest
import torch

from guided import LLM, SamplingParams
from guided.scheduler import policy
from guided.worker.loader import load_tokenizer, resolve_model_dir

NUM_TOKENS = 24
SYSTEM = "You are a concise assistant. Answer in one sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors and explain briefly why they are called primary.",
    "Hi",
    "Write a short poem about a lighthouse standing alone on a rocky coast at night, "
    "with waves crashing and a ship far away.",
]


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=True, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer("default")
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("default")),
                                                 dtype=torch.float32).eval()
    all_prompts = prompts(tokenizer)
    expected = []
    with torch.no_grad():
        for ids in all_prompts:
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            past, tokens = out.past_key_values, []
            for _ in range(NUM_TOKENS):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(input_ids=torch.tensor([[token]]), past_key_values=past,
                            use_cache=True)
                past = out.past_key_values
            expected.append(tokens)
    return all_prompts, expected


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_matches_transformers(reference, enable_prefix_caching):
    all_prompts, expected = reference
    llm = LLM(enable_prefix_caching=enable_prefix_caching, num_kv_blocks=128,
              max_num_batched_tokens=64)  # small budget: long prompts take chunked prefill
    first = llm.generate(all_prompts, GREEDY)
    assert [o.token_ids for o in first] == expected
    # again: with caching on, the shared system prompt and the earlier turns are cache hits
    second = llm.generate(all_prompts, GREEDY)
    assert [o.token_ids for o in second] == expected
    hits = llm.engine.stats().prefix_cache_hit_tokens_total
    assert (hits > 0) == enable_prefix_caching
    assert llm.engine.stats().kv_blocks_in_use == 0


def test_greedy_matches_transformers_under_preemption(reference, monkeypatch):
    all_prompts, expected = reference
    need = max(len(p) for p in all_prompts) + NUM_TOKENS
    monkeypatch.setattr(policy, "ADMISSION_LOOKAHEAD_TOKENS", 0)  # admit greedily: preempt
    llm = LLM(num_kv_blocks=-(-need // 16) + 2, enable_prefix_caching=False)
    outs = llm.generate(all_prompts, GREEDY)
    assert llm.engine.stats().preemptions_total > 0, "the KV budget was meant to force preemption"
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats().kv_blocks_in_use == 0
