#!/usr/bin/env bash
# Issue 38's no-regression matrix: every figure of its acceptance (0.8B dims: batch-1 decode
# fp32 and bf16, batch-16 decode, prefill 512; default model: batch-1 decode, MTP k=4), eager
# and compiled, at the native level and at avx2, as interleaved A/Bs (ab_decode.py) in both
# orders: A B, then B A. Nothing else may run meanwhile.
#
#   benchmarks/probes/ab_matrix.sh TREE_BASE TREE_NEW OUT_DIR [LEVEL ...]
# TREE_*: checkouts with their own .venv; the 0.8B checkpoint is made in /tmp/bench if missing.
set -euo pipefail
base=$1 new=$2 out=$3
shift 3
levels=${*:-native avx2}
here=$(cd "$(dirname "$0")" && pwd)
py="$new/.venv/bin/python"
mkdir -p "$out"
ckpt08=$("$py" -c "import sys; sys.path.insert(0, '$here/..'); from pathlib import Path; import bench_cpu; print(bench_cpu.checkpoint('0.8b', Path('/tmp/bench')))")
default=$("$py" -c "from hybrid_engine.default_model import default_model_path; print(default_model_path())")
# name checkpoint dtype steps pairs extra-args
configs=(
  "08b_fp32_b1      $ckpt08  float32  16  10"
  "08b_bf16_b1      $ckpt08  bfloat16 32  10"
  "08b_bf16_b16     $ckpt08  bfloat16 8   8   AB_BATCH=16"
  "08b_bf16_pf512   $ckpt08  bfloat16 1   8   AB_PREFILL=512"
  "default_b1       $default float32  256 20"
  "default_mtp4     $default float32  64  16  AB_SPEC_K=4"
)
for level in $levels; do
  isa=()
  [ "$level" = native ] || isa=("HYBRID_ENGINE_CPU_ISA=$level")
  for mode in eager compiled; do
    for c in "${configs[@]}"; do
      read -r name ck dtype steps pairs extra <<<"$c"
      steps_m=$steps
      [ "$mode" = compiled ] && [ "$name" = default_b1 ] && steps_m=512
      args=("$ck" "$dtype" "$steps_m" "$pairs")
      [ "$mode" = compiled ] && args+=(compiled)
      [ -n "${extra:-}" ] && args+=("$extra")
      args+=("${isa[@]}")
      tag="${level}_${name}_${mode}"
      echo "== $tag $(date -u +%H:%M:%S)"
      "$py" "$here/ab_decode.py" "$base" "$new" "${args[@]}" "$out/${tag}_bm.json" | sed -n 1p
      "$py" "$here/ab_decode.py" "$new" "$base" "${args[@]}" "$out/${tag}_mb.json" | sed -n 1p
    done
  done
done
echo ALLDONE
