#!/usr/bin/env bash
# Tensor parallelism on the CUDA backend (issue 19) in one device-machine call: build, the GPU tests of
# the device communicators (one-shot == rank-order sum bit for bit inside replayed graphs, 2 and 3
# ranks on one GPU; timeouts and aborts end a spinning rank) and of CudaTpRunner (TP=2 on one GPU in
# CUDA graphs: bit-identical over 10 runs and equal to the eager run), `bench comm --tp 2` (all-reduce
# latency in a graph, one-shot vs NCCL), `generate --backend cuda --tp 2` 10 times on the committed
# tiny_fixed_routing model comparing tokens (and once over the eager device-in-process communicator),
# the topology of both ranks, the same generate 10 times with rank 1 as a child process
# (--tp-transport processes: the one-shot all-reduce over CUDA IPC; tokens must equal the threads'
# runs, and no rank process may remain), then `bench --tp 2` once on the XS.2 shape cut to a few
# layers beside --tp 1. Logs and JSON under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/tp_check.sh [--skip-tests] [--skip-bench] [--skip-comm-bench] [--skip-fp8] [--layers N]
# --skip-fp8: without the FP8 runs (generate on the XS.2 shape cut to 2 layers with FP8 weights in
# 128 x 128 blocks, --tp 2 as threads and as processes, whose tokens must be equal, beside --tp 1).
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/tp_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
TESTS=1; BENCH=1; COMM_BENCH=1; FP8=1; LAYERS=4
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-bench) BENCH=0 ;;
    --skip-comm-bench) COMM_BENCH=0 ;;
    --skip-fp8) FP8=0 ;;
    --layers) shift; LAYERS=$1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
echo "GPUs: $(grep -vc '^name' "$OUT/gpu.txt")"
dl_build "$OUT" decodelab device_comm_gpu_test cuda_tp_gpu_test device_communicator_test comm_bench_test || exit 1
B=build/bin/decodelab
run_test() {  # name timeout
  timeout "$2" "./build/$1" > "$OUT/$(basename "$1").log" 2>&1
  local rc=$?
  echo "$(basename "$1") rc=$rc: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$(basename "$1").log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" "$OUT/$(basename "$1").log" | head -20
  grep -B1 -A8 "Failure" "$OUT/$(basename "$1").log" | head -60
  [ $rc = 124 ] && echo "  ** TIMED OUT (a hang?): last lines:" && tail -5 "$OUT/$(basename "$1").log"
}
if [ "$TESTS" = 1 ]; then
  run_test src/comm/device_communicator_test 60
  run_test src/comm/comm_bench_test 60
  run_test tests/gpu/device_comm_gpu_test 300
  run_test tests/gpu/cuda_tp_gpu_test 420
  grep -E "^\[tp(-fp8|-dflash)?\]" "$OUT/cuda_tp_gpu_test.log" | head -24
  # The one-shot and two-shot kernels under compute-sanitizer memcheck (peer slots, flags, epochs).
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/device_comm_gpu_test \
    --gtest_filter='*TwoShotBf16*:*OneShotBf16TwoRanks*' > "$OUT/memcheck_comm.log" 2>&1
  echo "memcheck device_comm_gpu_test TwoShot/OneShot rc=$?: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck_comm.log" | tr '\n' ' ')"
fi
if [ "$COMM_BENCH" = 1 ]; then
  timeout 180 $B bench comm --tp 2 --sizes 4K,16K,64K,1M --iters 200 --json-out "$OUT/bench_comm_tp2.json" \
    > "$OUT/bench_comm_tp2.log" 2>&1
  echo "bench comm --tp 2 rc=$?:"; cat "$OUT/bench_comm_tp2.log"
  timeout 180 $B bench comm --tp 3 --sizes 4K,1M --iters 100 > "$OUT/bench_comm_tp3.log" 2>&1
  echo "bench comm --tp 3 rc=$?:"; tail -6 "$OUT/bench_comm_tp3.log"
fi
# Greedy tokens, 10 runs, each a fresh process; then the eager communicator once.
M=tests/data/golden/tiny_fixed_routing
GEN=(generate --model "$M" --backend cuda --tp 2 --prompt-ids 2,17,42,7,99,3 --max-tokens 64 --ignore-eos
     --kv-dtype bf16 --allow-fallback --json)
for i in $(seq 1 10); do
  timeout 120 $B "${GEN[@]}" > "$OUT/generate_$i.json" 2> "$OUT/generate_$i.log" || echo "generate run $i FAILED rc=$?"
done
timeout 120 $B "${GEN[@]}" --tp-transport device-in-process > "$OUT/generate_eager.json" 2> "$OUT/generate_eager.log" \
  || echo "generate eager FAILED rc=$?"
# Rank 1 as a child process (this binary re-executed), 10 fresh groups.
for i in $(seq 1 10); do
  timeout 120 $B "${GEN[@]}" --tp-transport processes > "$OUT/generate_proc_$i.json" 2> "$OUT/generate_proc_$i.log" \
    || echo "generate processes run $i FAILED rc=$?"
done
echo "rank processes left after the processes runs: $(ps -eo args | grep -c '^[^ ]*decodelab __tp-rank')"
timeout 120 $B generate --model "$M" --backend cuda --prompt-ids 2,17,42,7,99,3 --max-tokens 64 --ignore-eos \
  --kv-dtype bf16 --allow-fallback --json > "$OUT/generate_tp1.json" 2> "$OUT/generate_tp1.log" || echo "generate tp1 FAILED"
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
def last(p):
    try:
        return json.loads(open(p).read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": str(e)}
runs = [last(f"{d}/generate_{i}.json") for i in range(1, 11)]
eager, tp1 = last(f"{d}/generate_eager.json"), last(f"{d}/generate_tp1.json")
toks = [r.get("tokens") for r in runs]
same = all(t == toks[0] and t is not None for t in toks)
print(f"generate --tp 2 x10: tokens {'IDENTICAL' if same else 'DIFFER'} ({len(toks[0] or [])} tokens)")
print(f"  eager device-in-process run: {'IDENTICAL' if eager.get('tokens') == toks[0] else 'DIFFER'}; "
      f"tp 1: {'same tokens' if tp1.get('tokens') == toks[0] else 'other tokens (allowed: BF16 partial sums)'}")
b = runs[0].get("backend", {})
tp = b.get("tensor_parallel", {})
print(f"  transport {tp.get('transport')}, graphs {tp.get('graphs')}, devices {[r.get('device') for r in tp.get('ranks', [])]}")
for t in b.get("topology", []):
    print(f"  topology rank {t.get('rank')}: kernel_nodes {t.get('kernel_nodes')} collectives {t.get('collectives')} "
          f"signature {t.get('signature')}")
et = eager.get("backend", {}).get("tensor_parallel", {})
print(f"  eager run: transport {et.get('transport')}, graphs {et.get('graphs')}")
procs = [last(f"{d}/generate_proc_{i}.json") for i in range(1, 11)]
ptoks = [r.get("tokens") for r in procs]
psame = all(t == toks[0] and t is not None for t in ptoks)
print(f"generate --tp 2 --tp-transport processes x10: tokens {'IDENTICAL to the threads runs' if psame else 'DIFFER'}")
pb = procs[0].get("backend", {})
ptp = pb.get("tensor_parallel", {})
print(f"  transport {ptp.get('transport')}, graphs {ptp.get('graphs')}, pids {[r.get('pid') for r in ptp.get('ranks', [])]}")
for t in pb.get("topology", []):
    print(f"  topology rank {t.get('rank')}: signature {t.get('signature')}")
PY
if [ "$BENCH" = 1 ]; then
  for tp in 1 2; do
    timeout 300 $B bench --shape xs2 --num-layers "$LAYERS" --kv-dtype bf16 --page-size 32 --prompt-len 512 --gen-len 128 \
      --repeat 1 --tp $tp --allow-fallback --json-out "$OUT/bench_tp$tp.json" > "$OUT/bench_tp$tp.log" 2>&1
    echo "bench --shape xs2 --num-layers $LAYERS --tp $tp rc=$?:"
    grep -E "^  (model|TPOT|device step|kernels)|error" "$OUT/bench_tp$tp.log" | head -6
  done
  python3 - "$OUT" <<'PY'
import json, sys
try:
    j = json.load(open(f"{sys.argv[1]}/bench_tp2.json"))
    b = j["backend"]
    print(f"  bench tp 2 backend: transport {b['tensor_parallel']['transport']}, graphs {b['tensor_parallel']['graphs']}, "
          f"topology {[t['signature'] for t in b['topology']]}")
except Exception as e:
    print(f"  bench tp 2 JSON: {e}")
PY
fi
if [ "$FP8" = 1 ]; then
  F8=(generate --shape xs2 --num-layers 2 --shape-dtype fp8 --backend cuda --prompt-ids 2,17,42,7,99,3 --max-tokens 32
      --ignore-eos --kv-dtype bf16 --allow-fallback --json)
  for v in "tp1:--tp 1" "threads:--tp 2 --tp-transport device-oneshot" "processes:--tp 2 --tp-transport processes"; do
    timeout 300 $B "${F8[@]}" ${v#*:} > "$OUT/fp8_${v%%:*}.json" 2> "$OUT/fp8_${v%%:*}.log" || { echo "fp8 ${v%%:*} FAILED rc=$?"; tail -3 "$OUT/fp8_${v%%:*}.log"; }
  done
  python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
def toks(n):
    try:
        return json.loads(open(f"{d}/fp8_{n}.json").read().strip().splitlines()[-1]).get("tokens")
    except Exception as e:
        return None
t1, th, pr = toks("tp1"), toks("threads"), toks("processes")
print(f"FP8 xs2 2 layers --tp 2: threads vs processes {'IDENTICAL' if th is not None and th == pr else 'DIFFER'}; "
      f"tp 1: {'same tokens' if t1 == th else 'other tokens (allowed: BF16 partial sums)'}; {len(th or [])} tokens")
print(f"  tp1 {t1[:12] if t1 else t1}\n  tp2 {th[:12] if th else th}")
PY
fi
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/tp_check_logs.tgz" -C /tmp tp_check 2>/dev/null
