#!/usr/bin/env bash
# guided and vLLM 0.22 on a synthetic shape (random weights), the same 512 JSON requests and the
# same output lengths: guided's JSON passes record each request's length (a grammar ends a
# request where its JSON ends), and every later pass, vLLM's included, asks each request for
# exactly that many tokens (ignore_eos). Without it vLLM, which goes on past the JSON's end,
# generates longer requests: fewer prefills per output token, a higher tok/s for the same speed.
#
# On the device, after ../shared/device/vllm/README.md's setup calls (its .dev/g carried):
#   SO_BACKEND=guidance bash benchmarks/beside_vllm.sh                  # llama-3-8b, 1 GPU, c64
#   SHAPE=llama-3-70b TP=4 CONC=64,256 SO_BACKEND=guidance bash benchmarks/beside_vllm.sh
#   ENGINES=guided ... (or vllm): one engine per call where both do not fit in 10 minutes
# vLLM gets a config.json of the same shape (written from guided's SYNTHETIC_SHAPES) and
# --load-format dummy; both engines run at tensor-parallel size TP.
# Rows: $OUT/rows.jsonl and the log, as run.sh writes them.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 SHAPE=${SHAPE:-llama-3-8b} TP=${TP:-1} CONC=${CONC:-64} ENGINES=${ENGINES:-"guided vllm"}
# run.sh finds its folder through $0: source it in a shell whose $0 is run.sh
exec bash -c '
source .dev/g/run.sh   # with no phases: its functions and settings only
LENGTHS=/tmp/lengths-guided-$SHAPE.json  # outlives a call: guided and vLLM may run in two
passes() {  # engine port [extra args]: JSON cold then warm at each concurrency, then free
  local e=$1 p=$2; shift 2
  local record=(--lengths-in "$LENGTHS")
  [ "$e" = guided ] && record=(--lengths-out "$LENGTHS")
  local first=${CONC%%,*}
  bench "$e $SHAPE tp$TP json (cold, warm)" "$p" "$JSONWL" --concurrency "$first,$CONC" "$@" "${record[@]}"
  bench "$e $SHAPE tp$TP free" "$p" "$FREEWL" --concurrency "$CONC" --lengths-in "$LENGTHS"
}
hf_config() {  # the shape as a Hugging Face llama config, for vLLM
  PYTHONPATH=$SRC:$GSITE python3 - "$SHAPE" <<"P"
import json, sys
from guided.worker.model_config import SYNTHETIC_SHAPES
s = dict(SYNTHETIC_SHAPES[sys.argv[1]])
print(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
    "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_heads"],
    "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"],
    "vocab_size": s["vocab_size"], "max_position_embeddings": s["max_position_embeddings"],
    "rope_theta": s.get("rope_theta", 10000.0), "rms_norm_eps": s.get("rms_norm_eps", 1e-5),
    "tie_word_embeddings": s.get("tie_word_embeddings", False), "hidden_act": "silu",
    "attention_bias": s.get("attention_bias", False), "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2}, indent=1))
P
}
guided_run() {
  # llguidance (a dependency of guided) compiles the long bounded strings; without it they
  # compile on xgrammar, slower: the rows say which ran
  if PYTHONPATH=$GSITE python3 -c "import llguidance" 2>/dev/null; then
    say "llguidance for guided: present"
  else say "llguidance for guided: missing (long bounded strings compile on xgrammar)"; fi
  start_server "guided-$SHAPE" 8100 guided_serve 8100 "synthetic:$SHAPE" \
    --tensor-parallel-size "$TP" || return 1
  passes guided 8100
  stop_server
}
vllm_run() {
  local d=/tmp/$SHAPE-shape; mkdir -p $d
  for f in "$MD"/*; do case $(basename "$f") in model.safetensors|config.json) ;; *) cp "$f" $d/ ;; esac; done
  hf_config > $d/config.json
  start_server "vllm-$SHAPE" 8200 vllm_serve 8200 $d --load-format dummy \
    --tensor-parallel-size "$TP" || return 1
  passes vllm 8200
  stop_server
}
[ -f "$MD/tokenizer.json" ] || PYTHONPATH=$SRC:$GSITE python3 -c "from guided.worker.loader import resolve_model_dir; resolve_model_dir(\"default\")"
for e in $ENGINES; do say "== $e $SHAPE tp$TP at $CONC"; ${e}_run; done
stop_server
cp "$LENGTHS" "$OUT/" 2>/dev/null
say "finished"
' .dev/g/run.sh
