"""The llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) in plain torch over a paged KV cache."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from guided.worker.models import ops

from guided.kernels.attention import paged_attention, paged_attention_ref
from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # each (num_blocks, block_size, num_kv_heads, head_dim)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
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
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


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
        t = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(self.cfg)).to(self.cos.device)  # (P, D/2)
        self.cos = freqs.cos()
        self.sin = freqs.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # one fused projection: a single GEMM instead of three (checkpoints are fused at load)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata, ops) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.rope(positions, q.view(T, self.num_heads, self.head_dim), rope.cos, rope.sin)
        k = ops.rope(positions, k.view(T, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # q (T, Hq, D); k, v (T, Hkv, D)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = k
        v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = v
        attend = paged_attention if meta.use_triton else paged_attention_ref
        out = attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                     scale=self.scale, max_query_len=meta.max_query_len,
                     max_seq_len=meta.max_seq_len)  # (T, Hq, D)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, residual, positions, rope, kv_cache, meta, ops):
        """h: this layer's normed input; residual: the stream before it. Returns the next
        layer's (normed input, residual) pair; the residual adds are fused into the norms."""
        attn = self.self_attn(h, positions, rope, kv_cache, meta, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.ops = ops.EAGER
        self.fused_ops = ops.EAGER

    def use_compiled_ops(self) -> None:
        """torch.compile'd elementwise ops for forward(fused=True): the CUDA graphs, where
        they cost nothing per call. Eager steps keep the plain ops: each compiled call checks
        its guards on the host (~30 layers x 4 calls), which outweighed the fusion there."""
        self.fused_ops = ops.compiled_ops()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata, *, fused: bool = False
                ) -> torch.Tensor:
        f = self.fused_ops if fused else self.ops
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
        return F.linear(hidden, weight)  # (N, V)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF names, fusing q/k/v and gate/up into our single projections."""
        own = self.state_dict()
        loaded: set[str] = set()
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                parts = [state.get(f"{p}self_attn.{n}_proj.{kind}") for n in "qkv"]
                if parts[0] is not None:
                    own[f"layers.{i}.self_attn.qkv_proj.{kind}"].copy_(torch.cat(parts, 0))
                    loaded.add(f"layers.{i}.self_attn.qkv_proj.{kind}")
            own[f"layers.{i}.mlp.gate_up_proj.weight"].copy_(torch.cat(
                [state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]], 0))
            loaded.add(f"layers.{i}.mlp.gate_up_proj.weight")
        for name, tensor in state.items():
            key = name.removeprefix("model.")
            if key in own and key not in loaded:
                own[key].copy_(tensor)
                loaded.add(key)
        missing = [k for k in own if k not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> None:
        """Synthetic models: N(0, 0.02) weights, unit norms; for speed and memory, not quality."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
