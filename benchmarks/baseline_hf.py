"""Baseline: the same workload through plain transformers `generate` + xgrammar's logits processor.

    python benchmarks/baseline_hf.py --model default --workload json --batch-size 64
    python benchmarks/baseline_hf.py --model synthetic:llama-3-8b --workload json.jsonl \
        --num-requests 256 --batch-size 64 --max-tokens 256

What a user would otherwise pick: static batches of `--batch-size` requests (left padding, greedy),
each batch running until its longest answer ends; constrained with
`xgrammar.contrib.hf.LogitsProcessor` (one compiled grammar per row; JSON compiled as the engine
does: strict, compact separators unless --any-whitespace) and free (no processor) on the same
prompts. Compile time counts in the wall time (the server compiles online too) and is also shown
apart. Synthetic models are transformers LlamaForCausalLM with random weights in the shapes of
guided/worker/model_config.py, with the default model's tokenizer, as the engine serves them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import workloads
from workloads import WorkItem, markdown

COLUMNS = [("label", "label", "{}"), ("workload", "workload", "{}"), ("mode", "mode", "{}"),
           ("batch_size", "batch", "{}"), ("requests", "n", "{}"),
           ("req_per_s", "req/s", "{:.2f}"), ("out_tok_per_s", "out tok/s", "{:.1f}"),
           ("mean_in", "in len", "{:.0f}"), ("mean_out", "out len", "{:.0f}"),
           ("valid", "valid", "{}"), ("truncated", "trunc", "{}"),
           ("rejected", "rejected", "{}"), ("compile_s", "compile s", "{:.2f}"),
           ("duration_s", "wall s", "{:.1f}")]


def load_model(name: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from guided.worker.loader import load_tokenizer, resolve_model_dir
    from guided.worker.model_config import SYNTHETIC_SHAPES

    tokenizer = load_tokenizer(name)
    if tokenizer.pad_token is None:  # left padding needs one; the model never sees it
        tokenizer.pad_token = tokenizer.eos_token
    if not name.startswith("synthetic:"):
        model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(name)), dtype=dtype)
        return model.to(device).eval(), tokenizer
    shape = dict(SYNTHETIC_SHAPES[name.split(":", 1)[1]])
    config = LlamaConfig(
        hidden_size=shape.pop("hidden_size"), intermediate_size=shape.pop("intermediate_size"),
        num_hidden_layers=shape.pop("num_layers"), num_attention_heads=shape.pop("num_heads"),
        num_key_value_heads=shape.pop("num_kv_heads"), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init directly in the target dtype, on the device
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval(), tokenizer


class Baseline:
    def __init__(self, model, tokenizer, *, any_whitespace: bool, max_tokens: int,
                 ignore_eos: bool):
        import xgrammar as xgr

        self.model, self.tokenizer, self.xgr = model, tokenizer, xgr
        self.any_whitespace, self.max_tokens, self.ignore_eos = any_whitespace, max_tokens, ignore_eos
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=8)
        self.pool = ThreadPoolExecutor(8)

    def compile(self, item: WorkItem):
        """The item's grammar, or the error text if xgrammar refuses the schema."""
        schema = item.body["response_format"]["json_schema"]["schema"]
        try:
            return self.compiler.compile_json_schema(
                json.dumps(schema), strict_mode=True, any_whitespace=self.any_whitespace)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            return f"{type(e).__name__}: {e}"

    @torch.inference_mode()
    def generate(self, items: list[WorkItem], grammars: list | None
                 ) -> tuple[list[list[int]], list[int]]:
        """Greedy answers (token ids, up to and including eos) of one static batch, and the
        prompt lengths."""
        from transformers import LogitsProcessorList
        from xgrammar.contrib.hf import LogitsProcessor

        prompts = [self.tokenizer.apply_chat_template(it.body["messages"], tokenize=False,
                                                      add_generation_prompt=True) for it in items]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=False).to(self.model.device)
        processors = LogitsProcessorList([LogitsProcessor(grammars)] if grammars else [])
        out = self.model.generate(
            **enc, max_new_tokens=self.max_tokens, do_sample=False, logits_processor=processors,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            min_new_tokens=self.max_tokens if self.ignore_eos else None)
        answers = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():  # (B, new_tokens)
            end = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            answers.append(row[:end])
        return answers, enc["attention_mask"].sum(dim=1).tolist()

    def run(self, items: list[WorkItem], batch_size: int, constrained: bool) -> dict:
        num_out = num_in = truncated = rejected = valid = checked = 0
        compile_s = 0.0
        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        for b in range(0, len(items), batch_size):
            batch, grammars = items[b:b + batch_size], None
            if constrained:
                t0 = time.perf_counter()
                compiled = list(self.pool.map(self.compile, batch))
                compile_s += time.perf_counter() - t0
                rejected += sum(isinstance(g, str) for g in compiled)
                batch = [it for it, g in zip(batch, compiled) if not isinstance(g, str)]
                grammars = [g for g in compiled if not isinstance(g, str)]
                if not batch:
                    continue
            answers, prompt_lens = self.generate(batch, grammars)
            num_in += sum(prompt_lens)
            for item, ids in zip(batch, answers):
                num_out += len(ids)
                done = bool(ids) and ids[-1] == self.eos_id
                truncated += not done
                if done and workloads.is_constrained(item):
                    checked += 1
                    valid += workloads.check(item, self.tokenizer.decode(
                        ids, skip_special_tokens=True), []) is None
        sync()
        duration = time.perf_counter() - start
        finished = len(items) - rejected
        return {"mode": "constrained" if constrained else "free", "batch_size": batch_size,
                    "requests": finished, "req_per_s": finished / duration,
                    "out_tok_per_s": num_out / duration, "mean_out": num_out / max(1, finished),
                    "mean_in": num_in / max(1, finished),
                    "valid": f"{valid}/{checked}" if checked else None, "truncated": truncated,
                    "rejected": rejected, "compile_s": compile_s, "duration_s": duration}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help='"default", an HF directory, or synthetic:<shape>')
    p.add_argument("--workload", default="json",
                   help="json or chat, or a .jsonl file written by --export-workload")
    p.add_argument("--data", type=Path, default=workloads.DEFAULT_DATA)
    p.add_argument("--export-workload", type=Path, metavar="FILE",
                   help="write the sampled requests to FILE (JSONL) and exit")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--batch-size", "--concurrency", type=int, default=64, dest="batch_size")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="fixed lengths (free mode only)")
    p.add_argument("--modes", default="constrained,free",
                   help="comma-separated: constrained, free")
    p.add_argument("--any-whitespace", action="store_true",
                   help="JSON with flexible whitespace (the engine's default is compact)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--json-out", type=Path, help="append the rows (JSON lines) to this file")
    args = p.parse_args(argv)

    items = workloads.build(args.workload, args.num_requests, seed=args.seed, data=args.data)
    if args.export_workload:
        workloads.save(items, args.export_workload)
        print(f"wrote {len(items)} {args.workload} requests to {args.export_workload}")
        return 0
    if any(it.kind == "tools" for it in items):
        print("baseline_hf.py: the tools workload is not supported (json, chat, shared-prefix)",
              file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.startswith("cuda") else torch.float32)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device, dtype)
    print(f"loaded {args.model} on {device} ({dtype}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    base = Baseline(model, tokenizer, any_whitespace=args.any_whitespace,
                    max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    base.generate(items[:2], None)  # warm-up (kernels, allocator)
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        constrained = mode == "constrained"
        if constrained and not any(workloads.is_constrained(it) for it in items):
            continue
        if constrained and args.ignore_eos:
            print("baseline_hf.py: --ignore-eos applies to free mode only", file=sys.stderr)
        print(f"running {mode} ({len(items)} requests, batch {args.batch_size})",
              file=sys.stderr)
        base.ignore_eos = args.ignore_eos and not constrained
        row = base.run(items, args.batch_size, constrained)
        row.update(label=args.label, workload=Path(args.workload).stem, model=args.model,
                   device=device, max_tokens=args.max_tokens)
        rows.append(row)
    print(markdown(rows, COLUMNS))
    print("\n(transformers generate, greedy, static batches; valid: complete constrained "
          "answers that validate; trunc: answers cut by max_tokens; rejected: schemas xgrammar "
          "refused, left out)")
    if args.json_out:
        with args.json_out.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
