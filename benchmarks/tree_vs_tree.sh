#!/usr/bin/env bash
# One GPU lease, two guided trees on the same requests: the redesign's no-slowdown check (issue 38).
# Runs on the device from the repo root, after ../shared/device/vllm/ set the machine up
# (`bash .dev/g/run.sh info setup` over its chunks: /tmp/site holds guided's wheels, /tmp/wl the
# JSON workload, /tmp/art the default model's GGUF). OLD and NEW are source trees (`git archive`
# of the two commits, unpacked), each measured with its own benchmarks/.
#
#   bash benchmarks/tree_vs_tree.sh serve      # default model, JSON at 64: cold then warm pass
#   ROUNDS=3 bash benchmarks/tree_vs_tree.sh serve   # old, new, old, new, ...: medians per pass
#   bash benchmarks/tree_vs_tree.sh trees DIR...   # serve's passes from each tree in turn
#   bash benchmarks/tree_vs_tree.sh offline C  # synthetic:llama-3-8b, engine_offline --paired at C
#   bash benchmarks/tree_vs_tree.sh free C     # the same, --free: every request max-tokens long
#   bash benchmarks/tree_vs_tree.sh common     # the workload's rows both trees serve -> /tmp/wl/both.jsonl
#
# --paired's free run replays its own tree's constrained lengths, and a random-weights model
# writes different JSON under the two trees' grammars (5-10% more tokens under the old one):
# compare its rows per step. `free` gives both trees the same token counts, so tok/s compares.
#
# Each tree refuses a few schemas (not the same ones), so `common` runs first: one token of each
# of the first 512 rows through both trees, keeping the rows both served; serve and offline then
# read /tmp/wl/both.jsonl when it is there (the same requests through both trees).
#
# PAIR_GPUS="0 1" runs the two trees at once, old on the first GPU and new on the second (a
# machine of several GPUs: same host, same moment); otherwise one after the other.
# Prints one table row per tree and pass; rows go to $OUT/tree_vs_tree.jsonl too.
# On the default model a pass is host-bound and ~5 s long: one H200 lease gave one tree
# 12744 then the next (the same hot path) 10256 tok/s warm, so serve's verdict is the median
# of ROUNDS interleaved rounds (benchmarks/results/device_s38.md).
# Each tree runs from its own directory (run from the repo root, the old tree refused every
# grammar: most likely its compile processes imported the repo's guided/) with a model cache of
# its own (/tmp/cache-old, /tmp/cache-new). CACHE_SEED: a directory copied into both first (a
# tokenizer-only conversion: synthetic shapes without the GGUF).
set -uo pipefail
OLD=${OLD:-.dev/g/old}
NEW=${NEW:-.dev/g/src}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GUIDED_DEFAULT_GGUF=${GUIDED_DEFAULT_GGUF:-/tmp/art/SmolLM2-135M-Instruct.Q4_1.gguf}
ALL=${ALL:-/tmp/wl/json.jsonl}
WL=$ALL; [ -s "/tmp/wl/both.jsonl" ] && WL=/tmp/wl/both.jsonl
say() { echo "[$(date +%T)] $*" | tee -a "$OUT/tree_vs_tree.log"; }

cache_for() {  # label: the tree's own model cache, seeded
  local cache=/tmp/cache-$1
  mkdir -p "$cache" && if [ -n "${CACHE_SEED:-}" ]; then cp -rn "$CACHE_SEED"/. "$cache"/; fi
  echo "$cache"
}

serve() {  # tree label
  local tree=$1 label=$2
  label=$label${ROUND:+-r$ROUND}
  local -x GUIDED_CACHE_DIR; GUIDED_CACHE_DIR=$(cache_for "$label")
  say "serve: $label ($tree)"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 420 python3 benchmarks/serve.py \
    --launch "--model default" --workload "$WL" --num-requests 512 --concurrency 64,64 \
    --max-tokens 256 --temperature 0 --label "$label" --json-out "$OUT/tree_vs_tree.jsonl" \
    2>>"$OUT/serve-$label.err") | tee -a "$OUT/tree_vs_tree.log"
}

offline() {  # tree label concurrency mode: engine_offline --paired or --free (see the top)
  local tree=$1 label=$2 c=$3 mode=$4
  local -x GUIDED_CACHE_DIR; GUIDED_CACHE_DIR=$(cache_for "$label")
  say "offline --$mode: $label at $c ($tree)"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 560 python3 benchmarks/engine_offline.py \
    --model synthetic:llama-3-8b --workload "$WL" --num-requests 256 --concurrency "$c" \
    --max-tokens 256 "--$mode" 2>>"$OUT/$mode-$label-$c.err") | tee -a "$OUT/tree_vs_tree.log"
}

served() {  # tree label: one token of each of the first 512 rows -> $OUT/kept-LABEL.json
  local tree=$1 label=$2
  local -x GUIDED_CACHE_DIR; GUIDED_CACHE_DIR=$(cache_for "$label")
  say "common: $label ($tree)"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 560 python3 benchmarks/engine_offline.py \
    --model synthetic:llama-3-8b --workload "$ALL" --num-requests 512 --max-tokens 1 \
    2>>"$OUT/common-$label.err" | tail -1 > "$OUT/kept-$label.json")
}

common() {
  both served
  python3 - "$ALL" "$OUT/kept-old.json" "$OUT/kept-new.json" > "/tmp/wl/both.jsonl" <<'PY'
import json, sys
rows = open(sys.argv[1]).read().splitlines()
old, new = (json.load(open(path))["lengths"] for path in sys.argv[2:])
print("\n".join(r for r, a, b in zip(rows, old, new) if a > 0 and b > 0))
print(f"rows both trees serve: {sum(a > 0 and b > 0 for a, b in zip(old, new))} of {len(old)}"
      f" (old refused {old.count(0)}, new {new.count(0)})", file=sys.stderr)
PY
}

both() {  # function [args after the tree and label]
  local fn=$1; shift
  if [ -n "${PAIR_GPUS:-}" ]; then
    read -r gold gnew <<< "$PAIR_GPUS"
    CUDA_VISIBLE_DEVICES=$gold $fn "$OLD" old "$@" &
    CUDA_VISIBLE_DEVICES=$gnew $fn "$NEW" new "$@" &
    wait
  else
    $fn "$OLD" old "$@"; $fn "$NEW" new "$@"
  fi
}

case ${1:-serve} in
  serve)
    skip=$(cat "$OUT/tree_vs_tree.jsonl" 2>/dev/null | wc -l)  # rows of earlier runs
    for ROUND in $(seq 1 "${ROUNDS:-1}"); do both serve; done
    python3 - "$OUT/tree_vs_tree.jsonl" "$skip" <<'PY' | tee -a "$OUT/tree_vs_tree.log"
import json, statistics, sys
from collections import defaultdict
rates = defaultdict(list)  # (tree, pass) -> out tok/s, a row per server launch and pass
seen = defaultdict(int)
for line in open(sys.argv[1]).read().splitlines()[int(sys.argv[2]):]:
    row = json.loads(line)
    label = row["label"]
    tree = label.split("-r")[0]
    rates[tree, "warm" if seen[label] else "cold"].append(row["out_tok_per_s"])
    seen[label] += 1
print("| pass | old tok/s (median of) | new tok/s (median of) | new / old |\n|---|---|---|---|")
for name in ("cold", "warm"):
    old, new = rates["old", name], rates["new", name]
    if old and new:
        a, b = statistics.median(old), statistics.median(new)
        print(f"| {name} | {a:.1f} ({len(old)}) | {b:.1f} ({len(new)}) | {b / a:.2f} |")
PY
    ;;
  offline) both offline "${2:-64}" paired ;;
  free) both offline "${2:-64}" free ;;
  common) common 2>&1 | tee -a "$OUT/tree_vs_tree.log" ;;
  trees) shift; for tree in "$@"; do serve "$tree" "$(basename "$tree")"; done ;;
  *) echo "usage: $0 serve | offline CONCURRENCY | free CONCURRENCY | common | trees DIR..." >&2
     exit 2 ;;
esac
