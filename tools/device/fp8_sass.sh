#!/usr/bin/env bash
# Static SASS counts of the FP8 kernels (THE FP8 RULE, kernels/ops.h) after a build: per kernel of
# gemv_fp8.cu.o and moe.cu.o whose name says FP8 (Fp8 / the MoE's *KernelW twins), the instructions in
# all, FFMA, FMUL, F2FP (e4m3x2 -> f16x2), HADD2.F32 (f16 -> f32) and local-memory LDL/STL. Under the
# rule a chunk costs 8 F2FP, 16 HADD2.F32 and 17 FFMA per token and no FMUL (the scale multiplies the
# chunk's sum in its last FFMA), so FMUL should be near zero in the GEMV kernels (the MoE's gate/up and
# down keep the few of their epilogues). Counts are static (unrolled code), not per chunk.
#   usage (repo root, GPU machine or any machine with cuobjdump): bash tools/device/fp8_sass.sh [build dir]
set -uo pipefail
BUILD=${1:-build}
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ ! -x "$CUOBJDUMP" ]; then echo "fp8 sass: no cuobjdump"; exit 0; fi
for name in gemv_fp8.cu.o moe.cu.o; do
  obj=$(find "$BUILD" -name "$name" | head -1)
  if [ -z "$obj" ]; then echo "fp8 sass: no $name under $BUILD"; continue; fi
  echo "sass $name:"
  printf "  %-8s %-6s %-6s %-6s %-10s %-8s %s\n" instrs FFMA FMUL F2FP HADD2.F32 LDL/STL kernel
  "$CUOBJDUMP" --dump-sass "$obj" | awk '
    /Function :/ { fn = $3; next }
    /\/\*[0-9a-f]+\*\/ / {
      line = $0
      sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, "", line)
      sub(/^@!?U?P[0-9T]+[ \t]+/, "", line)
      split(line, tok, /[ \t;]+/)
      op = tok[1]
      if (op == "") next
      total[fn]++
      if (op ~ /^FFMA/) ffma[fn]++
      if (op ~ /^FMUL/) fmul[fn]++
      if (op ~ /^F2FP/) f2fp[fn]++
      if (op ~ /^HADD2\.F32/) hadd[fn]++
      if (op ~ /^(LDL|STL)/) local_mem[fn]++
    }
    END {
      for (fn in total) {
        if (fn !~ /Fp8|KernelW/) continue
        printf "  %-8d %-6d %-6d %-6d %-10d %-8d %s\n", total[fn], ffma[fn], fmul[fn], f2fp[fn], hadd[fn], local_mem[fn], fn
      }
    }' | sort -k7
done
