"""The device timeline: CUDA events at each forward pass and sampling, read as the spans
between them (where the device works, and where it waits on the host)."""
from __future__ import annotations

import pytest
import torch

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine
from guided.worker.device_timeline import DeviceTimeline


def test_an_off_timeline_marks_nothing():
    timeline = DeviceTimeline(enabled=False)
    timeline.mark("forward")
    timeline.mark("sample")
    assert timeline.spans() == {} and timeline.longest_waits(3) == []
    assert timeline.summary() == "device timeline: no marks"


@pytest.mark.gpu
def test_spans_time_what_the_device_did_between_marks():
    timeline = DeviceTimeline(enabled=True)
    timeline.call = 1
    timeline.mark("forward")
    torch.cuda._sleep(2_000_000)  # ~1 ms of device time
    timeline.mark("decode end")
    timeline.call = 2
    timeline.mark("sample")
    spans = timeline.spans()
    assert spans["forward -> decode end"][0] > 0.1
    assert spans["decode end -> sample"][0] < spans["forward -> decode end"][0]
    (ms, call), = timeline.longest_waits(5)  # only spans that end at a sampling
    assert call == 2 and ms == spans["decode end -> sample"][0]


@pytest.mark.gpu
def test_an_overlapped_engine_marks_every_forward_and_sampling():
    engine = Engine(EngineConfig(model="synthetic:llama-3.2-1b", max_num_seqs=8,
                                 max_model_len=512, num_kv_blocks=128, device_timeline=True))
    try:
        for i in range(4):
            engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(
                max_tokens=8, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        spans = engine.runner.timeline.spans()
        assert 0 < len(spans["sample -> sample end"]) <= engine.step_times.counts["steps"]
        assert any(label.startswith("forward -> ") for label in spans)
        assert all(ms >= 0 for values in spans.values() for ms in values)
    finally:
        engine.shutdown()
