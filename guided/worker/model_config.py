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
    def from_hf(cls, cfg: dict, name: str) -> ModelConfig:
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


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
               "tie_word_embeddings")
_QWEN = {"rms_norm_eps": 1e-6, "attention_bias": True}

# Real shapes for synthetic models (random weights): speed and memory at scale, not quality.
# "tiny" (a forward pass of a few ms on a CPU) profiles the host's per-step work there.
SYNTHETIC_SHAPES: dict[str, dict] = {
    name: dict(zip(_SHAPE_KEYS, row)) | extra for name, *row, extra in (
        # name          hidden  inter layers heads kv head   vocab max_pos theta  tied
        ("tiny",            64,   128,   2,    2,  1,  32,  49152,   8192, 1e4, True, {}),
        ("smollm2-135m",   576,  1536,  30,    9,  3,  64,  49152,   8192, 1e5, True, {}),
        ("llama-3.2-1b",  2048,  8192,  16,   32,  8,  64, 128256, 131072, 5e5, True, {}),
        ("llama-3.2-3b",  3072,  8192,  28,   24,  8, 128, 128256, 131072, 5e5, True, {}),
        ("llama-3-8b",    4096, 14336,  32,   32,  8, 128, 128256,   8192, 5e5, False, {}),
        ("qwen2.5-7b",    3584, 18944,  28,   28,  4, 128, 152064,  32768, 1e6, False, _QWEN),
        ("llama-3-70b",   8192, 28672,  80,   64,  8, 128, 128256,   8192, 5e5, False, {}),
        ("qwen2.5-72b",   8192, 29568,  80,   64,  8, 128, 152064,  32768, 1e6, False, _QWEN),
        ("mistral-7b",    4096, 14336,  32,   32,  8, 128,  32768,  32768, 1e6, False, {}),
    )
}


def synthetic_config(shape: str) -> ModelConfig:
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"unknown synthetic model {shape!r}; known: {sorted(SYNTHETIC_SHAPES)}")
    return ModelConfig(name=f"synthetic:{shape}", **SYNTHETIC_SHAPES[shape])
