"""Engine behaviour with the real default model on the CPU: sampling, stops, aborts, no leaks."""
from __future__ import annotations

import json
import time

import pytest

from guided import LLM, InvalidRequestError, SamplingParams
from guided.scheduler import policy

PROMPT = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=96, max_num_seqs=8)


def prompt_ids(llm: LLM) -> list[int]:
    return llm.apply_chat_template(PROMPT)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt_ids(llm), p)[0]
    batch = llm.generate([prompt_ids(llm)] * 3, [p, SamplingParams(max_tokens=5, seed=7), p])
    assert batch[0].token_ids == alone.token_ids == batch[2].token_ids
    other = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=12, seed=99,
                                                         ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=8, temperature=0))[0]
    top_k = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=8, top_k=1, seed=3))[0]
    top_p = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=8, top_p=1e-6, seed=4))[0]
    assert greedy.token_ids == top_k.token_ids == top_p.token_ids


def test_penalties_change_the_output(llm):
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt_ids(llm), base)[0]
    rep = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True,
                                                       frequency_penalty=2.0,
                                                       repetition_penalty=1.5))[0]
    assert rep.token_ids != plain.token_ids
    assert len(set(rep.token_ids)) >= len(set(plain.token_ids))


def test_a_constraint_no_token_can_continue_fails_alone_as_a_constraint_error(llm):
    # SmolLM2 has no token for the UTF-8 lead byte F1, which U+40000 starts with
    dead, after_a = (SamplingParams(regex=r, max_tokens=4, temperature=0)
                     for r in ("\U00040000", "a\U00040000"))
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt_ids(llm)] * 3, [dead, after_a, plain])
    for out, text in zip(outs[:2], ("", "a")):
        assert out.finish_reason == "error" and out.error_type == "constraint"
        assert "cannot be completed with this model's vocabulary" in out.error
        assert out.text == text
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 6


def test_stop_string_truncates_and_max_tokens_limits(llm):
    out = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=40, temperature=0,
                                                       ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    word = out.text.split()[3]
    stopped = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=40, temperature=0,
                                                           stop=[word]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == out.text[:out.text.index(word)]
    zero = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=0))[0]
    assert zero.finish_reason == "length" and zero.token_ids == []


def test_logprobs(llm):
    out = llm.generate(prompt_ids(llm), SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                       ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the sampled token is the best


def test_bad_input_raises_clear_errors(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([[5] * 9000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    # the engine is unharmed
    assert llm.generate(prompt_ids(llm), SamplingParams(max_tokens=2))[0].finish_reason


def test_no_block_leaks_after_finish_abort_and_preemption(monkeypatch):
    monkeypatch.setattr(policy, "ADMISSION_LOOKAHEAD_TOKENS", 0)  # admit greedily: preempt
    llm = LLM(num_kv_blocks=7, max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    ids = prompt_ids(llm)
    for i in range(6):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True,
                                                        seed=i))
    steps = 0
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 3:
            engine.abort_request("r1")  # running
            engine.abort_request("r5")  # still waiting
        if steps == 8:
            engine.abort_request("r2")
    assert finished == {f"r{i}" for i in range(6)}
    stats = engine.stats()
    assert stats.preemptions_total > 0
    assert stats.requests_finished_total == {"abort": 3, "length": 3}
    assert stats.kv_blocks_in_use == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_final_outputs_come_once_with_the_text_streaming_makes(llm):
    """output_kind "final" (LLM.generate, non-streaming server requests): no output before the
    finish, and the same tokens and text as a request that reports every step; an abort
    reports the text of the tokens so far."""
    import jsonschema

    engine = llm.engine
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    ids = prompt_ids(llm)
    seen: dict[str, list] = {"cum": [], "fin": []}
    for kind, rid in (("cumulative", "cum"), ("final", "fin")):
        engine.add_request(rid, ids, SamplingParams(max_tokens=40, temperature=0,
                                                    json_schema=schema, output_kind=kind))
    engine.add_request("cut", ids, SamplingParams(max_tokens=200, temperature=0,
                                                  ignore_eos=True, output_kind="final"))
    steps = 0
    while any(r in engine.requests for r in ("cum", "fin")):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        steps += 1
    engine.abort_request("cut")
    outs = engine.step()
    cut = [o for o in outs if o.request_id == "cut"]
    assert steps > 2 and len(seen["cum"]) > 2 and len(seen["fin"]) == 1
    assert "cut" not in seen  # unfinished: nothing reported
    final, cumulative = seen["fin"][0], seen["cum"][-1]
    assert final.finished and cumulative.finished
    assert final.token_ids == cumulative.token_ids and final.text == cumulative.text
    jsonschema.validate(json.loads(final.text), schema)
    assert len(cut) == 1 and cut[0].finish_reason == "abort" and cut[0].token_ids
    assert cut[0].text == llm.tokenizer.decode(cut[0].token_ids, skip_special_tokens=True)


def test_a_final_output_ending_on_a_stop_token_leaves_it_out_of_the_text(llm):
    """The final text is decoded with the outputs, after the finish: the stop token that ended
    the request is kept in the ids and never decoded, as for a request reporting every step."""
    engine = llm.engine
    ids = prompt_ids(llm)
    probe = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    stop = probe.token_ids[6]
    got = {}
    for kind in ("cumulative", "final"):
        engine.add_request(kind, ids, SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[stop], skip_special_tokens=False,
            output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
    final, cumulative = got["final"], got["cumulative"]
    assert final.finish_reason == "stop" and final.token_ids[-1] == stop
    assert final.token_ids == cumulative.token_ids and final.text == cumulative.text
    assert final.text == llm.tokenizer.decode(final.token_ids[:-1])


def test_a_fault_in_one_request_of_a_running_batch_fails_that_request_only(llm):
    """A request whose grammar raises inside a step (its matcher's accept here) ends with an
    error; the others in the batch run on and their outputs validate."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    engine = llm.engine
    ids = prompt_ids(llm)
    for rid in ("ok1", "bad", "ok2"):
        engine.add_request(rid, ids, SamplingParams(max_tokens=24, temperature=0,
                                                    json_schema=schema))
    while engine.requests["bad"].matcher is None:  # compiled and admitted
        engine.step()

    def broken(token_id):
        raise RuntimeError("injected fault")

    engine.requests["bad"].matcher.accept_token = broken
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].finish_reason == "error" and done["bad"].error_type == "internal"
    for rid in ("ok1", "ok2"):
        assert done[rid].finish_reason == "stop", done[rid]
        jsonschema.validate(json.loads(done[rid].text), schema)
    assert engine.stats().kv_blocks_in_use == 0


def test_with_only_compiles_pending_the_engine_waits_for_one_instead_of_spinning(llm):
    engine = llm.engine
    schema = {"type": "object", "properties": {"wait_probe": {"type": "integer", "minimum": 7}},
              "required": ["wait_probe"]}  # compiled nowhere else: pending once added
    engine.add_request("wait-probe", prompt_ids(llm),
                       SamplingParams(max_tokens=4, json_schema=schema))
    request = engine.requests["wait-probe"]
    t0 = time.monotonic()
    engine.wait_for_compiles(timeout=60)
    assert request.grammar_future.done() and time.monotonic() - t0 < 60
    engine.step()  # promoted and launched: there is a step to run, so no waiting
    t0 = time.monotonic()
    engine.wait_for_compiles(timeout=5)
    assert time.monotonic() - t0 < 0.5
    while engine.has_unfinished_requests():
        engine.step()
    assert request.is_finished and request.finish_reason in ("stop", "length")
