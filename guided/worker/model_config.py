"""The architecture numbers of a llama-family model, read from config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, fields


# ModelConfig's names for config.json's keys, where they differ
_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the embedding = width of the logits (may exceed the tokenizer's)
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3-style {"rope_type": "llama3", "factor", ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections

    @classmethod
    def from_hf(cls, cfg: dict, name: str) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
        if arch not in supported:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            name=name,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        )

    def to_hf(self) -> dict:
        qwen = self.attention_bias
        return {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
                "model_type": "qwen2" if qwen else "llama", "hidden_act": "silu",
                "torch_dtype": "float32",
                **{_HF_KEYS.get(f.name, f.name): getattr(self, f.name)
                   for f in fields(self) if f.name != "name"}}


# Real shapes for synthetic models (random weights): speed and memory at scale, not quality.
SYNTHETIC_SHAPES: dict[str, dict] = {
    # the host loop's shape: a forward pass of a few ms on a CPU, for profiling the host's
    # per-step work there (scheduling, grammar, drafts) against a near-free model
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=32, vocab_size=49152, max_position_embeddings=8192,
                 tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                         num_kv_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       attention_bias=True),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, vocab_size=128256,
                        max_position_embeddings=8192, rope_theta=500000.0),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, vocab_size=152064,
                        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                        attention_bias=True),
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, vocab_size=32768,
                       max_position_embeddings=32768, rope_theta=1000000.0),
}


def synthetic_config(shape: str) -> ModelConfig:
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"unknown synthetic model {shape!r}; known: {sorted(SYNTHETIC_SHAPES)}")
    return ModelConfig(name=f"synthetic:{shape}", **SYNTHETIC_SHAPES[shape])
