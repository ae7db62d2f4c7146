"""Llama-family GGUF files: their config, and their tensors under HF names, either all of them
dequantized (the one-time conversion to safetensors) or a rank's slices (GgufReader)."""
from __future__ import annotations

from pathlib import Path

import torch

from guided.worker.model_config import ModelConfig
from guided.worker.models.weights import MissingWeight, Piece, check_shape

# rows dequantized at once for a column slice, whose every row must be read: the peak is one
# chunk of one tensor (a 29568-wide row of fp32: 1024 rows ~ 120 MB), never the whole tensor
CHUNK_ROWS = 1024

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved per head for its rope; HF uses the half-split layout.
    out_dim = w.shape[0]
    return (w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (None: not a weight the model has)."""
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


def _rope_heads(arch: str, config: ModelConfig, gguf_name: str) -> int | None:
    """q/k of a llama GGUF: their head count (their rows are permuted per head); else None."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if arch != "llama" or kind not in ("attn_q", "attn_k"):
        return None
    return config.num_heads if kind == "attn_q" else config.num_kv_heads


def read_gguf_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and every tensor, dequantized to fp32: the whole model in memory at once."""
    reader = GgufReader(path)
    tensors = {}
    for name, t in reader.tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[name] = torch.empty(shape)
        reader.read_into(Piece(name, shape), tensors[name])
    return reader.config, tensors


class GgufReader:
    """A rank's slices of a GGUF's tensors, dequantized from the memory-mapped file a chunk of
    rows at a time: quantized blocks run along a row, so a row slice (qkv, gate_up, the vocab)
    dequantizes its own rows only; a column slice (o, down) dequantizes every row, a chunk at a
    time, and keeps its columns."""

    def __init__(self, path: Path):
        import gguf

        self._reader = gguf.GGUFReader(str(path))
        self.config = gguf_config(self._reader, path)
        self._arch = self._reader.fields["general.architecture"].contents()
        self.tensors = {hf_name(t.name): t for t in self._reader.tensors if hf_name(t.name)}

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        from gguf.quants import dequantize

        t = self.tensors.get(piece.name)
        if t is None:
            raise MissingWeight(piece.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        check_shape(piece, shape)
        if len(shape) == 1:
            out.copy_(torch.from_numpy(dequantize(t.data, t.tensor_type).copy()))
            return
        rows = range(piece.start, piece.stop) if piece.dim == 0 else range(shape[0])
        cols = slice(piece.start, piece.stop) if piece.dim == 1 else slice(None)
        heads = _rope_heads(self._arch, self.config, t.name)
        head_rows = shape[0] // heads if heads else 1
        step = max(head_rows, CHUNK_ROWS // head_rows * head_rows)  # whole heads: unpermutable
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            chunk = torch.from_numpy(dequantize(t.data[start:stop], t.tensor_type).copy())
            chunk = chunk.reshape(stop - start, shape[1])  # (rows, cols) fp32
            if heads:
                chunk = _unpermute_rope(chunk, (stop - start) // head_rows)
            out[start - rows.start:stop - rows.start].copy_(chunk[:, cols])
