#!/usr/bin/env bash
# py-spy over a guided server's processes during one JSON pass at concurrency 64, on the device
# after ../shared/device/vllm/'s set-up (its .dev/g carried), with a py-spy binary (PyPI
# `py-spy`: the GPU image has none) at $PYSPY:
#   PYSPY=.dev/prof/py-spy MODEL=default PASS=warm bash benchmarks/profile_serve.sh
#   PYSPY=.dev/prof/py-spy MODEL=synthetic:llama-3-8b PASS=cold bash benchmarks/profile_serve.sh
#   PYSPY=.dev/prof/py-spy MODEL=synthetic:llama-3-70b TP=4 PASS=warm bash benchmarks/profile_serve.sh
# PASS=warm serves the workload once unprofiled first (every grammar compiled), cold profiles the
# first pass. GIL=1 samples only the threads holding the GIL (py-spy --gil): who keeps the step
# loop waiting for it. Writes $OUT/profile.txt (py-spy's raw format) and prints its summary
# (benchmarks/pyspy_summary.py) and the server's last stats lines.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 MODEL=${MODEL:-default} TP=${TP:-1} PASS=${PASS:-warm} PROFILE_S=${PROFILE_S:-10} PYSPY=${PYSPY:?PYSPY}
exec bash -c '
source .dev/g/run.sh   # with no phases: its functions and settings only
cp "$PYSPY" /tmp/py-spy && chmod +x /tmp/py-spy
extra=(); [[ $MODEL == synthetic:* ]] && extra=(--ignore-eos)
start_server guided 8100 guided_serve 8100 "$MODEL" --tensor-parallel-size "$TP" || exit 1
[ "$PASS" = warm ] && bench "unprofiled" 8100 "$JSONWL" --concurrency 64 "${extra[@]}"
gil=(); [ "${GIL:-0}" = 1 ] && gil=(--gil)
/tmp/py-spy record --pid "$SPID" --subprocesses --threads --rate 200 --format raw --nonblocking \
  "${gil[@]}" -o "$OUT/profile.txt" --duration "$PROFILE_S" > "$OUT/py-spy.log" 2>&1 &
profiler=$!
bench "$PASS (profiled)" 8100 "$JSONWL" --concurrency 64 "${extra[@]}"
wait $profiler
python3 benchmarks/pyspy_summary.py "$OUT/profile.txt"
grep "guided.stats" "$OUT/server-guided.log" | tail -4 | cut -c1-600
stop_server
' .dev/g/run.sh
