"""The llama model sharded over 2 gloo ranks (float32, CPU) against the same model whole: the
same logits and the same greedy tokens, through the model's own forward pass over a paged KV
cache holding each rank's KV heads; weights read shard by shard (GGUF, safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tp_ranks import run_ranks

from guided.worker.loader import (
    default_gguf_path,
    load_model_config,
    load_tokenizer,
    resolve_model_dir,
    weight_reader,
)
from guided.worker.model_config import SYNTHETIC_SHAPES, ModelConfig
from guided.worker.models.llama import AttentionMetadata, LlamaForCausalLM, build_model
from guided.worker.models.parallel import SINGLE, ParallelContext, rank_device

BLOCK_SIZE = 16
NUM_STEPS = 6
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a JSON object describing a cat with a name and an age:",
           "1, 2, 3, 4,"]
CPU, F32 = torch.device("cpu"), torch.float32


def greedy(model: LlamaForCausalLM, prompts: list[list[int]], num_steps: int
           ) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill the prompts in one packed pass, then decode num_steps - 1 tokens each: the
    logits of every step's last positions (steps, B, V) and the greedy tokens (B, steps)."""
    cfg = model.config
    num_reqs = len(prompts)
    blocks_per_req = -(-(max(map(len, prompts)) + num_steps) // BLOCK_SIZE)
    device = model.norm.weight.device
    cache = torch.zeros(cfg.num_layers, 2, num_reqs * blocks_per_req, BLOCK_SIZE,
                        len(model.layout.kv_heads), cfg.head_dim, device=device)  # its KV heads
    kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
    tables = torch.arange(num_reqs * blocks_per_req, dtype=torch.int32,
                          device=device).view(num_reqs, -1)
    feed, num_computed = [list(p) for p in prompts], [0] * num_reqs
    tokens: list[list[int]] = [[] for _ in prompts]
    step_logits = []
    for _ in range(num_steps):
        ids, positions, slots, starts = [], [], [], [0]
        for r, new in enumerate(feed):
            for j, token in enumerate(new):
                pos = num_computed[r] + j
                ids.append(token)
                positions.append(pos)
                slots.append(int(tables[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            starts.append(starts[-1] + len(new))
        seq_lens = [c + len(new) for c, new in zip(num_computed, feed)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device), block_tables=tables,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(map(len, feed)), max_seq_len=max(seq_lens), use_triton=False)
        with torch.no_grad():
            hidden = model(torch.tensor(ids, device=device),
                           torch.tensor(positions, device=device), kv_caches, meta)
            logits = model.compute_logits(hidden[torch.tensor(starts[1:]) - 1])  # (B, V)
        step_logits.append(logits.cpu())
        for r, token in enumerate(logits.argmax(-1).tolist()):
            tokens[r].append(token)
        num_computed, feed = seq_lens, [[t[-1]] for t in tokens]
    return torch.stack(step_logits), tokens


def _run_model(ctx: ParallelContext, model_name: str, prompts: list[list[int]],
               device_type: str = "cpu") -> dict:
    cfg = load_model_config(model_name)
    device = rank_device(device_type)  # cuda:LOCAL_RANK (0 outside the ranks), or the CPU
    reader = weight_reader(model_name)
    model = build_model(cfg, reader, device=device, dtype=F32, ctx=ctx)
    logits, tokens = greedy(model, prompts, NUM_STEPS)
    return {"logits": logits, "tokens": tokens, "kv_heads": model.layout.kv_heads,
            "reader": type(reader).__name__,
            "num_params": sum(p.numel() for p in model.parameters()),
            "qkv_rows": model.layers[0].self_attn.qkv_proj.weight.shape[0]}


def assert_same_as_one_rank(model_name: str, prompts: list[list[int]],
                            device_type: str = "cpu") -> None:
    whole = _run_model(SINGLE, model_name, prompts, device_type)
    assert_same_outputs(whole, run_ranks(_run_model, 2, model_name, prompts, device_type,
                                         device_type=device_type))


def assert_same_outputs(whole: dict, ranks: list[dict]) -> None:
    for out in ranks:
        torch.testing.assert_close(out["logits"], whole["logits"], rtol=1e-4, atol=1e-4)
        assert out["tokens"] == whole["tokens"]


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = load_tokenizer("default")
    return [tokenizer.encode(p) for p in PROMPTS]


def test_default_model_on_two_ranks_equals_one_rank(prompt_ids, tmp_path, monkeypatch):
    whole = _run_model(SINGLE, "default", prompt_ids)  # from its converted safetensors
    # the ranks read their slices from the GGUF itself: their cache holds no converted weights
    monkeypatch.setenv("GUIDED_CACHE_DIR", str(tmp_path))
    resolve_model_dir(str(default_gguf_path()), need_weights=False)  # config, tokenizer: once
    ranks = run_ranks(_run_model, 2, str(default_gguf_path()), prompt_ids)
    assert [out["reader"] for out in [whole, *ranks]] == [
        "SafetensorsReader", "GgufReader", "GgufReader"]
    assert_same_outputs(whole, ranks)
    cfg = load_model_config("default")  # 3 KV heads: 2 on rank 0, 1 on rank 1
    assert [out["kv_heads"] for out in ranks] == [range(0, 2), range(2, 3)]
    group_rows = (cfg.num_heads // cfg.num_kv_heads + 2) * cfg.head_dim  # a KV group's q, k, v
    assert [out["qkv_rows"] for out in ranks] == [2 * group_rows, group_rows]
    # the ranks hold disjoint slices: together the whole model, plus the norms each one copies
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    assert sum(out["num_params"] for out in ranks) == whole["num_params"] + norms


@pytest.mark.gpu
def test_default_model_on_two_gpus_equals_one_gpu(prompt_ids):
    """The same through NCCL (float32; the torch attention reference on both sides)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert_same_as_one_rank("default", prompt_ids, device_type="cuda")


@pytest.mark.parametrize("changes", [
    # Qwen2-like: q/k/v biases, an untied LM head, a vocab that does not split evenly,
    {"attention_bias": True, "tie_word_embeddings": False, "vocab_size": 1001,
     "intermediate_size": 151},  # and an MLP width that splits 76 + 75
    # one KV head for two ranks: each rank holds a copy of it
    {"num_heads": 4, "num_kv_heads": 1, "vocab_size": 1000},
])
def test_small_shapes_on_two_ranks_equal_one_rank(tmp_path, changes):
    cfg = ModelConfig(name="small", **{
        **SYNTHETIC_SHAPES["smollm2-135m"], "hidden_size": 64, "intermediate_size": 160,
        "num_layers": 2, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16, **changes})
    model_dir = save_random_checkpoint(cfg, tmp_path)
    prompts = [[5, 17, 300, 2, 999], [1, 2, 3], list(range(40, 70))]
    assert_same_as_one_rank(str(model_dir), prompts)


def save_random_checkpoint(cfg: ModelConfig, out: Path) -> Path:
    """An HF directory (config.json, model.safetensors) holding random weights of shape cfg."""
    from safetensors.torch import save_file

    from guided.worker.models.weights import RandomWeights

    model = build_model(cfg, RandomWeights(seed=1), device=CPU, dtype=F32)
    save_file(weights_by_name(model), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    return out


def weights_by_name(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The whole model's weights under their HF names (q/k/v and gate/up split again)."""
    from guided.worker.models.llama import weight_pieces

    params = dict(model.named_parameters())
    state = {}
    for name, pieces in weight_pieces(model.config, model.layout).items():
        rows = params[name].split([p.slice_shape[0] for p in pieces])
        state.update({p.name: t.contiguous() for p, t in zip(pieces, rows)})
    return state


def _synthetic_rank(ctx: ParallelContext) -> dict:
    model = build_model(load_model_config("synthetic:tiny"), weight_reader("synthetic:tiny"),
                        device=CPU, dtype=F32, ctx=ctx)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    q_size = model.layers[0].self_attn.q_size
    _, tokens = greedy(model, [[1, 2, 3, 4]], 2)
    return {"kv_rows": qkv[q_size:].clone(), "q_rows": qkv[:q_size].clone(), "tokens": tokens}


def test_synthetic_shapes_are_generated_per_shard():
    """synthetic:tiny's one KV head is replicated on both ranks, with the same numbers; the
    query heads differ; each rank generated only its own slices."""
    first, second = run_ranks(_synthetic_rank, 2)
    torch.testing.assert_close(first["kv_rows"], second["kv_rows"], rtol=0, atol=0)
    assert not torch.equal(first["q_rows"], second["q_rows"])
    assert first["tokens"] == second["tokens"]
