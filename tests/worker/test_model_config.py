"""ModelConfig.num_params against the weights the model actually builds."""
from __future__ import annotations

import dataclasses

import pytest

from guided.worker.model_config import SYNTHETIC_SHAPES, ModelConfig, synthetic_config
from guided.worker.models.llama import LlamaForCausalLM


@pytest.mark.parametrize("tied", [True, False])
def test_num_params_counts_the_built_models_weights(tied):
    small = {**SYNTHETIC_SHAPES["smollm2-135m"], "hidden_size": 64, "intermediate_size": 96,
             "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "vocab_size": 500, "tie_word_embeddings": tied}
    config = ModelConfig(name="test", **small)
    model = LlamaForCausalLM(config)
    assert config.num_params == sum(p.numel() for p in model.parameters())
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    assert untied.num_params - config.num_params == (0 if not tied else 500 * 64)


@pytest.mark.parametrize("shape,billions", [("llama-3-8b", 8.03), ("llama-3-70b", 70.55),
                                            ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.71)])
def test_synthetic_shapes_have_their_model_cards_parameter_counts(shape, billions):
    assert synthetic_config(shape).num_params / 1e9 == pytest.approx(billions, rel=2e-3)
