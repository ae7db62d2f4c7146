"""Tensor parallelism: joining the ranks over env:// and their collectives, which slices each rank
holds, and each sharded layer (on 2 gloo ranks) against its unsharded self."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tp_ranks import run_ranks

from guided.worker.model_config import SYNTHETIC_SHAPES, ModelConfig, synthetic_config
from guided.worker.models.llama import EAGER, LlamaForCausalLM, build_model, weight_pieces
from guided.worker.models.parallel import (
    SINGLE,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    env_rank,
    gather_logits,
    init_distributed,
    shard_layout,
    split_range,
)
from guided.worker.models.weights import MissingWeight, Piece, check_shape

HIDDEN, IN_FEATURES, TOKENS = 48, 70, 7
VOCAB = 101  # odd: the last rank's vocab slice is short and padded


class StateDictReader:
    """Pieces of an in-memory HF state dict."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        if piece.name not in self.state:
            raise MissingWeight(piece.name)
        t = self.state[piece.name]
        check_shape(piece, tuple(t.shape))
        out.copy_(t if piece.dim is None else t.narrow(piece.dim, piece.start,
                                                          piece.stop - piece.start))


def small_config(**changes) -> ModelConfig:
    shape = {**SYNTHETIC_SHAPES["smollm2-135m"], "hidden_size": HIDDEN, "intermediate_size": 96,
             "num_layers": 2, "num_heads": 6, "num_kv_heads": 3, "head_dim": 8,
             "vocab_size": VOCAB, **changes}
    return ModelConfig(name="test", **shape)


def test_without_the_environment_a_process_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert env_rank() == (0, 1, 0)
    assert init_distributed(torch.device("cpu")) is SINGLE  # no process group at world size 1
    assert not torch.distributed.is_initialized()


def test_a_rank_outside_the_world_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        env_rank()


def _collectives(ctx: ParallelContext) -> dict:
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * ctx.rank
    return {"rank": ctx.rank, "env": env_rank(), "sum": ctx.all_reduce(x.clone()),
            "gathered": ctx.all_gather(x), "min": ctx.all_min(100 - ctx.rank)}


def test_collectives_on_two_ranks():
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    for rank, out in enumerate(run_ranks(_collectives, 2)):
        assert out["rank"] == rank and out["env"] == (rank, 2, rank)
        assert torch.equal(out["sum"], 2 * base + 10)
        assert torch.equal(out["gathered"], torch.stack([base, base + 10]))
        assert out["min"] == 99


def test_split_range_covers_every_index_once():
    for size in (1, 5, 9, 64, 29568):
        for world in (1, 2, 3, 4, 8):
            if world > size:
                continue
            parts = [split_range(size, r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(size))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("shape,world", [("smollm2-135m", 2), ("smollm2-135m", 3),
                                         ("llama-3-8b", 4), ("llama-3-70b", 8),
                                         ("qwen2.5-72b", 8), ("qwen2.5-7b", 4),
                                         ("tiny", 2), ("llama-3.2-1b", 8)])
def test_each_query_head_on_one_rank_with_the_kv_head_it_reads(shape, world):
    cfg = synthetic_config(shape)
    group = cfg.num_heads // cfg.num_kv_heads
    layouts = [shard_layout(cfg, r, world) for r in range(world)]
    assert [h for lay in layouts for h in lay.q_heads] == list(range(cfg.num_heads))
    for lay in layouts:
        # local query head j reads local KV head j // local group, as the attention kernel does
        local_group = len(lay.q_heads) // len(lay.kv_heads)
        for j, head in enumerate(lay.q_heads):
            assert lay.kv_heads[j // local_group] == head // group
    assert [i for lay in layouts for i in lay.intermediate] == list(range(cfg.intermediate_size))
    assert [i for lay in layouts for i in lay.vocab] == list(range(cfg.vocab_size))
    assert {lay.vocab_rows for lay in layouts} == {-(-cfg.vocab_size // world)}


def test_fewer_kv_heads_than_ranks_replicates_them():
    cfg = synthetic_config("tiny")  # 2 query heads, 1 KV head
    assert [shard_layout(cfg, r, 2).kv_heads for r in range(2)] == [range(0, 1)] * 2
    cfg = small_config(num_heads=8, num_kv_heads=2)
    assert [shard_layout(cfg, r, 4).kv_heads for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]


def test_a_world_size_that_cannot_split_the_heads_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 8"):
        shard_layout(synthetic_config("qwen2.5-7b"), 0, 8)  # 28 query heads over 8 ranks


def test_world_size_one_builds_the_plain_layers():
    model = LlamaForCausalLM(small_config(tie_word_embeddings=False))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert type(model.embed_tokens) is nn.Embedding
    assert model.embed_tokens.weight.shape == (VOCAB, HIDDEN)
    assert model.lm_head.weight.shape == (VOCAB, HIDDEN)


def _sharded_layers(ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The sharded layers' outputs on this rank, from the full weights every rank draws alike."""
    gen = torch.Generator().manual_seed(0)
    w_row = torch.randn(HIDDEN, IN_FEATURES, generator=gen)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen)
    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    cols = split_range(IN_FEATURES, ctx.rank, ctx.world_size)
    row = RowParallelLinear(len(cols), HIDDEN, ctx)
    layout = shard_layout(small_config(), ctx.rank, ctx.world_size)
    emb = VocabParallelEmbedding(layout, HIDDEN, ctx)
    with torch.no_grad():
        row.weight.copy_(w_row[:, cols.start:cols.stop])
        local = table[layout.vocab.start:layout.vocab.stop]
        emb.weight.zero_()[:len(local)].copy_(local)
        return {"row": row(x[:, cols.start:cols.stop]), "embedding": emb(ids),
                "logits": gather_logits(hidden, emb.weight, VOCAB, ctx),
                "expected_row": F.linear(x, w_row), "expected_embedding": F.embedding(ids, table),
                "expected_logits": F.linear(hidden, table)}


def test_sharded_layers_equal_the_unsharded_ones():
    for out in run_ranks(_sharded_layers, 2):
        for name in ("row", "embedding", "logits"):
            assert out[name].shape == out[f"expected_{name}"].shape
            torch.testing.assert_close(out[name], out[f"expected_{name}"], rtol=1e-5, atol=1e-5)
        assert out["logits"].is_contiguous()


def random_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole random checkpoint under HF names."""
    gen = torch.Generator().manual_seed(0)
    pieces = weight_pieces(cfg, shard_layout(cfg, 0, 1)).values()
    return {p.name: 0.1 * torch.randn(p.shape, generator=gen) for parts in pieces for p in parts}


def _sharded_projections(ctx: ParallelContext) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(this rank's output, the whole model's output at this rank's rows) per projection."""
    cfg = small_config(attention_bias=True, intermediate_size=97)  # splits 49 + 48
    state = random_state(cfg)
    cpu = torch.device("cpu")
    whole = build_model(cfg, StateDictReader(state), device=cpu, dtype=torch.float32)
    shard = build_model(cfg, StateDictReader(state), device=cpu, dtype=torch.float32, ctx=ctx)
    lay, d = shard.layout, cfg.head_dim
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    attn_in = torch.randn(TOKENS, cfg.num_heads * d, generator=torch.Generator().manual_seed(2))
    q_cols = slice(lay.q_heads.start * d, lay.q_heads.stop * d)
    kv = slice(lay.kv_heads.start * d, lay.kv_heads.stop * d)
    inter = slice(lay.intermediate.start, lay.intermediate.stop)
    w_attn, s_attn = whole.layers[0].self_attn, shard.layers[0].self_attn
    w_mlp, s_mlp = whole.layers[0].mlp, shard.layers[0].mlp
    with torch.no_grad():
        q, k, v = w_attn.qkv_proj(x).split([w_attn.q_size, w_attn.kv_size, w_attn.kv_size], -1)
        gate, up = w_mlp.gate_up_proj(x).chunk(2, dim=-1)
        return {"qkv": (s_attn.qkv_proj(x), torch.cat([q[:, q_cols], k[:, kv], v[:, kv]], -1)),
                "gate_up": (s_mlp.gate_up_proj(x), torch.cat([gate[:, inter], up[:, inter]], -1)),
                "o": (s_attn.o_proj(attn_in[:, q_cols]), w_attn.o_proj(attn_in)),
                "mlp": (s_mlp(x, EAGER), w_mlp(x, EAGER))}


def test_sharded_projections_equal_the_unsharded_ones():
    """Column-parallel qkv (with biases) and gate_up give this rank's rows of the whole output;
    row-parallel o and the whole MLP (an uneven split) give the whole output."""
    for out in run_ranks(_sharded_projections, 2):
        for name, (got, want) in out.items():
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
