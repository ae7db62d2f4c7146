"""The synthetic shapes build models of their model cards' parameter counts."""
from __future__ import annotations

import pytest
import torch

from guided.worker.model_config import synthetic_config
from guided.worker.models.llama import LlamaForCausalLM


@pytest.mark.parametrize("shape,billions", [("llama-3-8b", 8.03), ("llama-3-70b", 70.55),
                                            ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.71)])
def test_synthetic_shapes_have_their_model_cards_parameter_counts(shape, billions):
    with torch.device("meta"):  # the real modules, no memory
        model = LlamaForCausalLM(synthetic_config(shape))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=2e-3)
