#!/usr/bin/env bash
# guided and vLLM 0.22 on the llama-3-8b shape (random weights), the same 512 JSON requests and
# the same output lengths: guided's JSON passes record each request's length (a grammar ends a
# request where its JSON ends), and every later pass, vLLM's included, asks each request for
# exactly that many tokens (ignore_eos). Without it vLLM, which goes on past the JSON's end,
# generates longer requests: fewer prefills per output token, a higher tok/s for the same speed.
#
# On the device, after ../shared/device/vllm/README.md's setup calls (its .dev/g carried):
#   SO_BACKEND=guidance bash benchmarks/beside_vllm.sh
# Rows: $OUT/rows.jsonl and the log, as run.sh writes them.
set -uo pipefail
# run.sh finds its folder through $0: source it in a shell whose $0 is run.sh
exec bash -c '
source .dev/g/run.sh   # with no phases: its functions and settings only
LENGTHS=$OUT/lengths-guided.json
three_passes() {  # engine model port [extra args]: JSON cold and warm, then free, equal lengths
  local e=$1 m=$2 p=$3; shift 3
  local record=(--lengths-in "$LENGTHS")
  [ "$e" = guided ] && record=(--lengths-out "$LENGTHS")
  bench "$e $m json (cold, warm)" "$p" "$JSONWL" --concurrency 64,64 "$@" "${record[@]}"
  bench "$e $m free" "$p" "$FREEWL" --concurrency 64 --lengths-in "$LENGTHS"
}
for phase in g8b v8b; do say "== phase $phase"; $phase; done
stop_server
say "finished"
' .dev/g/run.sh
