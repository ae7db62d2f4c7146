#!/usr/bin/env bash
# The GPU runs behind benchmarks/RESULTS.md, by phase (each fits one device call):
#   bash benchmarks/gpu_suite.sh serve-8b    # serving: json vs chat, prefix cache on/off
#   bash benchmarks/gpu_suite.sh baseline-8b # transformers + xgrammar baseline
#   bash benchmarks/gpu_suite.sh default     # the default model (needs GUIDED_DEFAULT_GGUF)
#   bash benchmarks/gpu_suite.sh paired      # constrained / free, overlapped vs synchronous (MODEL=...)
#   bash benchmarks/gpu_suite.sh status-ratio  # issue 6's checks, one call each (MODEL=...):
#   bash benchmarks/gpu_suite.sh profile-serve # status-serve's serving run under py-spy (a wheel in
#                                            # .whl/), 4 s windows: benchmarks/thread_states.py
#   bash benchmarks/gpu_suite.sh profile-gil   # the same run, py-spy --gil (not pausing it) over the
#                                            # cold pass and the warm one: where the step loop's
#                                            # GIL time goes (thread_states.py --functions)
#   bash benchmarks/gpu_suite.sh status-serve  #   ratio (one wave and steady state), floor, serve, baseline
#   bash benchmarks/gpu_suite.sh multistep   # constrained / free with 8 decode steps a call (MODEL=...)
#   bash benchmarks/gpu_suite.sh dfa C       # constrained / free at concurrency C with the token-level
#                                            # DFA off, on, and on with 8 decode steps a call (MODEL=...)
#   bash benchmarks/gpu_suite.sh device C    # 8 decode steps a call, jump-forward off: DFA rows masked and
#                                            # stepped on the device, then on the host (MODEL=...)
# Workloads are exported beforehand (the GPU machine has no ../shared):
#   python benchmarks/serve.py --workload json --num-requests 512 --export-workload .work/json.jsonl
#   (and chat, shared-prefix; status-ratio's steady state also needs
#   python benchmarks/serve.py --workload json --num-requests 1024 --export-workload .work/json1024.jsonl)
set -uo pipefail
out=${OUT:-/tmp/guided-gpu}
mkdir -p "$out"
w=${WORKLOADS:-.work}
phase=${1:-serve-8b}
M=${MODEL:-synthetic:llama-3-8b}
serve() { python benchmarks/serve.py "$@" --json-out "$out/serve.jsonl" 2>>"$out/serve.err" | tee -a "$out/serve.md"; }
serve_profiled() {
  # status-serve's serving run in the background with the stats log every 2 s; once it
  # generates: $bench its pid, $pid the engine's own process (--engine-process), else the server
  rm -f /tmp/guided-serve-*.log
  serve --launch "--model $M --compile-threads 12 --log-stats-interval-s 2 ${SERVE_ARGS:-}" \
    --workload $w/json.jsonl --num-requests 512 --concurrency 64,64 --max-tokens 256 \
    --label "$M constrained" &
  bench=$!
  until server=$(pgrep -f "guided.server.cli serve" | head -1) && [ -n "$server" ] &&
        grep -qs "generation" /tmp/guided-serve-*.log; do sleep 0.2; done
  pid=$(pgrep -P "$server" -f spawn_main | head -1)
  pid=${pid:-$server}
}
case "$phase" in
serve-8b|serve)
  serve --launch "--model $M" --workload $w/json.jsonl --num-requests 512 --concurrency 64,256 \
    --max-tokens 256 --label "$M constrained"
  serve --launch "--model $M" --workload $w/chat.jsonl --num-requests 512 --concurrency 64,256 \
    --max-tokens 256 --ignore-eos --label "$M free"
  serve --launch "--model $M" --workload $w/shared-prefix.jsonl --num-requests 256 \
    --concurrency 64 --max-tokens 64 --ignore-eos --label "$M cache-on"
  serve --launch "--model $M --no-enable-prefix-caching" --workload $w/shared-prefix.jsonl \
    --num-requests 256 --concurrency 64 --max-tokens 64 --ignore-eos --label "$M cache-off"
  ;;
baseline-8b|baseline)
  python benchmarks/baseline_hf.py --model $M --workload $w/json.jsonl --num-requests 128 \
    --batch-size 64 --max-tokens 256 --label "$M" 2>>"$out/baseline.err" | tee "$out/baseline.md"
  ;;
default)
  # the default model (real weights): decode table, jump-forward on/off, serving, baseline
  python benchmarks/decode_throughput.py --model default --batch 1,16,64,256 \
    2>>"$out/decode.err" | tee "$out/decode_default.md"
  python benchmarks/jump_forward.py --device cuda --data "${DATA:-../shared/data}" \
    2>>"$out/jf.err" | tee "$out/jump_forward.md"
  M=default
  serve --launch "--model $M" --workload $w/json.jsonl --num-requests 512 --concurrency 64,256 \
    --max-tokens 256 --label "$M constrained"
  serve --launch "--model $M" --workload $w/chat.jsonl --num-requests 512 --concurrency 64,256 \
    --max-tokens 256 --ignore-eos --label "$M free"
  python benchmarks/baseline_hf.py --model $M --workload $w/json.jsonl --num-requests 128 \
    --batch-size 64 --max-tokens 256 --label "$M" 2>>"$out/baseline.err" | tee "$out/baseline.md"
  ;;
paired)
  # constrained / free on the same prompts and lengths, overlapped scheduling (the GPU default)
  # and synchronous steps, at concurrency 64 and 256
  for c in 64 256; do
    for mode in true false; do
      python benchmarks/engine_offline.py --model $M --workload $w/json.jsonl --num-requests 256 \
        --concurrency $c --max-tokens 256 --paired --set async_scheduling=$mode \
        2>>"$out/paired.err" | tee -a "$out/paired.md"
    done
  done
  ;;
status-ratio)
  # constrained / free on the same prompts and lengths: one wave of 256 (the longest request
  # bounds it), the steady state (1024 requests through 256 slots), and 64 slots
  run() { python benchmarks/engine_offline.py --model $M --max-tokens 256 --paired "$@" \
    2>>"$out/status.err" | tee -a "$out/status_ratio.md"; }
  run --workload $w/json.jsonl --num-requests 256 --concurrency 256 --rounds 4
  run --workload $w/json1024.jsonl --num-requests 1024 --concurrency 256 --rounds 3
  run --workload $w/json.jsonl --num-requests 256 --concurrency 64 --rounds 3
  [ "$M" = default ] || python benchmarks/decode_throughput.py --model $M --batch 1 \
    --scheduler-steps 1,8 2>>"$out/status.err" | tee -a "$out/status_ratio.md"
  ;;
multistep)
  # constrained / free at 256 and 64 with 8 decode steps a scheduler call (synchronous), jump-
  # forward off and on, beside the default (overlapped, one step a call) in the same process order
  run() { python benchmarks/engine_offline.py --model $M --workload $w/json.jsonl --max-tokens 256 \
    --num-requests 256 --paired --rounds 3 "$@" 2>>"$out/multistep.err" | tee -a "$out/multistep.md"; }
  for c in 256 64; do
    run --concurrency $c --no-jump-forward --set num_scheduler_steps=8
    run --concurrency $c --set num_scheduler_steps=8
    run --concurrency $c
  done
  ;;
dfa)
  # JSON schemas on xgrammar alone (dfa_masks off) against the token-level DFA (the default),
  # overlapped (the GPU default), then the DFA with 8 decode steps a call, jump-forward off
  c=${2:-256}
  run() { python benchmarks/engine_offline.py --model $M --workload $w/json.jsonl --max-tokens 256 \
    --num-requests 256 --concurrency $c --paired --rounds 3 "$@" 2>>"$out/dfa.err" | tee -a "$out/dfa.md"; }
  run --set dfa_masks=false
  run
  run --no-jump-forward --set num_scheduler_steps=8
  ;;
device)
  # multi-step calls with DFA grammars stepped on the device (device_dfa, the default) and on
  # the host (device_dfa off: each step's DFA rows filled by the host between the steps)
  c=${2:-256}
  run() { python benchmarks/engine_offline.py --model $M --workload $w/json.jsonl --max-tokens 256 \
    --num-requests 256 --concurrency $c --paired --rounds 3 --no-jump-forward \
    --set num_scheduler_steps=8 "$@" 2>>"$out/device.err" | tee -a "$out/device.md"; }
  run
  run --set device_dfa=false
  ;;
status-serve)
  # through the server: 512 JSON-schema requests at concurrency 64, cold caches then warm,
  # beside transformers + xgrammar on the same requests (its compiles counted, as ours are)
  serve --launch "--model $M --compile-threads 12 ${SERVE_ARGS:-}" --workload $w/json.jsonl \
    --num-requests 512 --concurrency 64,64 --max-tokens 256 --label "$M constrained ${SERVE_ARGS:-}"
  python benchmarks/baseline_hf.py --model $M --workload $w/json.jsonl --num-requests \
    ${BASELINE_N:-512} --batch-size 64 --max-tokens 256 --modes constrained --label "$M" \
    2>>"$out/baseline.err" | tee "$out/baseline.md"
  ;;
profile-serve)
  # status-serve's cold and warm passes with the stats log every 2 s, the server sampled by
  # py-spy in windows of 4 s with native frames (every thread: running, GIL, device, waits)
  # and of 2 s with --gil (who holds it); the stats log's times say which window was cold
  serve_profiled
  for i in 1 2 3 4 5 6 7 8; do
    kill -0 "$bench" 2>/dev/null || break
    echo "window $i: $(date +%T.%N)" | tee -a "$out/windows.txt"
    py-spy record --pid "$pid" --threads --idle --native -r ${RATE:-20} -d 4 -f raw \
      -o "$out/native$i.txt" >>"$out/pyspy.err" 2>&1
    py-spy record --pid "$pid" --threads --gil --nonblocking -r 100 -d 2 -f raw \
      -o "$out/gil$i.txt" >>"$out/pyspy.err" 2>&1
  done
  wait "$bench"
  cp /tmp/guided-serve-*.log "$out/" 2>/dev/null
  python benchmarks/thread_states.py "$out"/native*.txt "$out"/gil*.txt > "$out/thread_states.md"
  (cd "$out" && tar czf pyspy.tgz native*.txt gil*.txt pyspy.err windows.txt && \
    rm -f native*.txt gil*.txt)
  ;;
profile-gil)
  serve_profiled
  py-spy record --pid "$pid" --threads --gil --nonblocking -r 200 -d ${COLD_S:-10} -f raw \
    -o "$out/gil_cold.txt" >>"$out/pyspy.err" 2>&1
  # the warm pass: every grammar cached, the prompts' prefixes too
  until grep -qs "prefix cache 9[0-9]% hit | grammar cache 100%" /tmp/guided-serve-*.log ||
        ! kill -0 "$bench" 2>/dev/null; do sleep 0.2; done
  py-spy record --pid "$pid" --threads --gil --nonblocking -r 200 -d ${WARM_S:-4} -f raw \
    -o "$out/gil_warm.txt" >>"$out/pyspy.err" 2>&1
  wait "$bench"
  cp /tmp/guided-serve-*.log "$out/" 2>/dev/null
  python benchmarks/thread_states.py "$out/gil_cold.txt" "$out/gil_warm.txt" --functions 60 \
    > "$out/gil_functions.md"
  ;;
esac
