"""The llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) in plain torch over a paged KV
cache: the whole model, or one tensor-parallel rank's shard of it (models/parallel.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from guided.kernels.attention import paged_attention, paged_attention_ref
from guided.kernels.rope_kv import rope_write_kv, rope_write_kv_ref
from guided.kernels.silu_mul import silu_mul
from guided.worker.model_config import ModelConfig
from guided.worker.models import parallel as tp
from guided.worker.models.weights import Piece, WeightReader, load_pieces

# The norms as pure functions: CUDA graphs run them through torch.compile (one fused kernel
# each); eager steps and the CPU run them as written. silu * mul is a Triton kernel of its own.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


EAGER = SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_mul=silu_mul)


# each (num_blocks, block_size, num_kv_heads, head_dim); sharded: this rank's KV heads only
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    """A step's attention inputs, shared by every layer."""
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block * block_size + offset) per new token
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32: packed query offsets
    seq_lens: torch.Tensor  # (B,) int32: kv length per request, new tokens included
    max_query_len: int
    max_seq_len: int
    use_triton: bool  # False on the CPU: the torch reference serves


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(cfg.max_position_embeddings, cfg.head_dim // 2),
                             persistent=False)
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        cfg, dim = self.cfg, self.cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            factor = scaling["factor"]
            low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
            old_len = scaling.get("original_max_position_embeddings", 8192)
            wavelen = 2 * math.pi / inv_freq
            smooth = ((old_len / wavelen) - low) / (high - low)
            scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
            inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq,
                                   scaled)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float()).to(self.cos.device)  # (P, D/2)
        self.cos = freqs.cos()
        self.sin = freqs.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    """This rank's heads: qkv column-parallel (one fused GEMM), o row-parallel."""

    def __init__(self, cfg: ModelConfig, layout: tp.ShardLayout, ctx: tp.ParallelContext):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            len(layout.q_heads), len(layout.kv_heads), cfg.head_dim)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = tp.row_parallel_linear(self.q_size, cfg.hidden_size, ctx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        k_cache, v_cache = kv_cache
        rope_kv = rope_write_kv if meta.use_triton else rope_write_kv_ref
        q = rope_kv(self.qkv_proj(x), positions, rope.cos, rope.sin, k_cache, v_cache,
                    meta.slot_mapping, self.num_heads)  # (T, Hq, D); k, v into their slots
        attend = paged_attention if meta.use_triton else paged_attention_ref
        out = attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                     scale=self.scale, max_query_len=meta.max_query_len,
                     max_seq_len=meta.max_seq_len)  # (T, Hq, D)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """This rank's intermediate columns: gate_up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, layout: tp.ShardLayout, ctx: tp.ParallelContext):
        super().__init__()
        width = len(layout.intermediate)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)  # [gate; up]
        self.down_proj = tp.row_parallel_linear(width, cfg.hidden_size, ctx)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: tp.ShardLayout, ctx: tp.ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layout, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layout, ctx)

    def forward(self, h, residual, positions, rope, kv_cache, meta, ops):
        """h: this layer's normed input; residual: the stream before it."""
        attn = self.self_attn(h, positions, rope, kv_cache, meta)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    """The whole model (ctx SINGLE), or rank ctx.rank's shard of it: the hidden states and the
    logits are whole on every rank either way."""

    def __init__(self, cfg: ModelConfig, ctx: tp.ParallelContext = tp.SINGLE):
        super().__init__()
        self.config = cfg
        self.ctx = ctx
        self.layout = tp.shard_layout(cfg, ctx.rank, ctx.world_size)
        self.embed_tokens = tp.vocab_embedding(self.layout, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.layout, ctx)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, self.layout.vocab_rows, bias=False))
        self.fused_ops = EAGER

    def use_compiled_ops(self) -> None:
        """Compiled ops for forward(fused=True), the CUDA graphs: eager steps keep the plain
        ops, as the compiled calls' guard checks on the host outweighed the fusion there."""
        self.fused_ops = SimpleNamespace(silu_mul=silu_mul, **{
            name: torch.compile(fn, dynamic=True, fullgraph=True)
            for name, fn in (("rms_norm", rms_norm), ("add_rms_norm", add_rms_norm))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata, *, fused: bool = False
                ) -> torch.Tensor:
        f = self.fused_ops if fused else EAGER
        residual = self.embed_tokens(input_ids)  # (T, H)
        first = self.layers[0].input_layernorm
        h = f.rms_norm(residual, first.weight, first.eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            out, residual = layer(h, residual, positions, self.rope, kv_cache, meta, f)
            norm = (self.layers[i + 1].input_layernorm if i + 1 < len(self.layers)
                    else self.norm)
            h, residual = f.add_rms_norm(out, residual, norm.weight, norm.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.ctx.world_size == 1:
            return F.linear(hidden, weight)  # (N, V)
        return tp.gather_logits(hidden, weight, self.config.vocab_size, self.ctx)


def weight_pieces(cfg: ModelConfig, layout: tp.ShardLayout) -> dict[str, list[Piece]]:
    """Our parameter name -> its HF checkpoint slices for this rank: q/k/v and gate/up fused
    along the output rows, o and down sliced along the input columns."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_rows = (layout.q_heads.start * d, layout.q_heads.stop * d)
    kv_rows = (layout.kv_heads.start * d, layout.kv_heads.stop * d)
    proj_shapes = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
    vocab = (layout.vocab.start, layout.vocab.stop)
    pieces = {"embed_tokens.weight": [Piece("model.embed_tokens.weight", (cfg.vocab_size, h), 0,
                                            *vocab)],
              "norm.weight": [Piece("model.norm.weight", (h,))]}
    if not cfg.tie_word_embeddings:
        pieces["lm_head.weight"] = [Piece("lm_head.weight", (cfg.vocab_size, h), 0, *vocab)]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            pieces[f"{dst}self_attn.qkv_proj.{kind}"] = [
                Piece(f"{src}self_attn.{n}_proj.{kind}",
                      (proj_shapes[n], h) if kind == "weight" else (proj_shapes[n],), 0,
                      *(q_rows if n == "q" else kv_rows)) for n in "qkv"]
        pieces[f"{dst}self_attn.o_proj.weight"] = [
            Piece(f"{src}self_attn.o_proj.weight", (h, cfg.num_heads * d), 1, *q_rows)]
        pieces[f"{dst}mlp.gate_up_proj.weight"] = [
            Piece(f"{src}mlp.{n}_proj.weight", (inter, h), 0, layout.intermediate.start,
                  layout.intermediate.stop) for n in ("gate", "up")]
        pieces[f"{dst}mlp.down_proj.weight"] = [
            Piece(f"{src}mlp.down_proj.weight", (h, inter), 1, layout.intermediate.start,
                  layout.intermediate.stop)]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            pieces[f"{dst}{norm}.weight"] = [Piece(f"{src}{norm}.weight", (h,))]
    return pieces


def build_model(cfg: ModelConfig, reader: WeightReader, *, device: torch.device,
                dtype: torch.dtype, ctx: tp.ParallelContext = tp.SINGLE) -> LlamaForCausalLM:
    """Rank ctx.rank's shard on device, its parameters allocated once in dtype and filled from
    reader. Every rank runs forward() on the same inputs in the same order: the collectives
    pair up by order."""
    with torch.device("meta"):  # no time spent on an init the weights overwrite
        model = LlamaForCausalLM(cfg, ctx)
    model.to(dtype)  # on meta, free: never allocated in fp32 first
    model.to_empty(device=device)
    model.rope.reset_tables()  # fp32
    load_pieces(model, weight_pieces(cfg, model.layout), reader)  # this rank's slices only
    return model.eval()
