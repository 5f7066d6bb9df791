#!/usr/bin/env bash
# Issue 8 on two H200s: (1) the training step of configs/hybrid_125m.yaml on 1 GPU vs FSDP (fsdp=2) vs data
# parallel (data=2): per-step losses on the same batches, tokens/s per GPU, scaling efficiency
# (scripts/multi_gpu_train_check.py); (2) context-parallel KDA forward+backward at T = 524288 on 2 GPUs vs 1 GPU,
# with the 1-GPU T series (benchmarks/bench_context_parallel.py --platform gpu). Writes into $OUT.
#
# The device call (one call, both parts, about 9 minutes; .whl holds the pyyaml and tqdm wheels):
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="bash benchmarks/h200_issue8.sh")
# Or one part per call, each with more time for its jobs (about 5 minutes each):
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="PARTS=train TRAIN_BUDGET=540 bash benchmarks/h200_issue8.sh")
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="PARTS=cp CP_BUDGET=520 bash benchmarks/h200_issue8.sh")
#
# Knobs (environment): PARTS ("train cp"), TRAIN_BUDGET (seconds for part 1, default 320, a hard `timeout`: the JSON
# is rewritten after each mesh, so a cut run keeps the meshes done), TRAIN_STEPS (10), TRAIN_MESHES ("1 fsdp=2
# data=2"), TRAIN_ARGS (more arguments, e.g. "--set model.backend=auto"), CP_BUDGET (seconds for part 2's jobs,
# default: what is left of 540 s since the start, at least 120), CP_ARGS (more arguments for
# bench_context_parallel.py, e.g. "--dtype float32" or "--cp-T 524288 1048576"), MEM_FRACTION (0.95 of each GPU's
# memory for JAX).
#
# Time estimate (1 H200: hybrid_125m compiled in ~60 s and ran 0.34 s per 32768-token step, 97.7k tokens/s):
#   part 1: start + model ~15 s; 3 compiles of ~60-90 s (the 2-GPU steps also partition); 3 x 10 steps x 0.2-0.35 s:
#     ~4.5 min (TRAIN_BUDGET 320 s caps it);
#   part 2: each job a process (~10 s start); KDA fwd+bwd compiles ~20-40 s each; a step at T = 524288 about 1 s;
#     copying one T = 524288 result to the host for the comparison ~10 s. The jobs run in this order: the 1-GPU
#     series (T = 64K..512K, stopping at the first size that does not fit), context parallel at 524288 (+ the 1-GPU
#     comparison where it fits), context parallel at the largest T that fits one GPU (with the comparison), fewer
#     heads (8, then 4) at 524288 if it did not fit; sizes that cannot fit (XLA's memory analysis, or extrapolated
#     from the compiled sizes) are recorded as "oom-predicted" without running; jobs past the budget as "skipped".
#     XLA:CPU's accounting of the same programs (--compile-only here) says 51 / 102 / 204 / 409 GiB for one device at
#     T = 64K / 128K / 256K / 512K and 240 GiB per device for context parallel at 512K (120 at 256K): if the GPU's
#     figures are close, one GPU holds T <= 128K and the T = 524288 run needs the fewer-heads fallback; in one call
#     part 2 has ~3.5 minutes, enough for the series, 524288 and the 128K comparison; the fallbacks may be "skipped"
#     (PARTS=cp in a call of its own leaves time for all of them).
set -uo pipefail
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The machines keep NVLink multicast off (it can take the shared GPUs out of service); JAX's collectives go through
# NCCL, so say it here too, for every process this script starts.
export NCCL_NVLS_ENABLE=0
# With preallocation off the allocator still stops at a fraction of the GPU (75% by default): allow more. Only the
# new name: jaxlib 0.11.2 refuses XLA_CLIENT_MEM_FRACTION together with the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION.
unset XLA_PYTHON_CLIENT_MEM_FRACTION
export XLA_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95}
OUT=${OUT:-out}
mkdir -p "$OUT"
PARTS=${PARTS:-train cp}
DAY=$(date -u +%F)
{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')  parts: $PARTS" \
    " NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/issue8-env.log"

if [[ " $PARTS " == *" train "* ]]; then
  echo "== part 1: train step, 1 GPU vs fsdp=2 vs data=2 (budget ${TRAIN_BUDGET:-320} s)"
  CMD="python3 scripts/multi_gpu_train_check.py --config configs/hybrid_125m.yaml --device gpu \
--steps ${TRAIN_STEPS:-10} --meshes ${TRAIN_MESHES:-1 fsdp=2 data=2} --set model.backend=chunk \
--set schedule.warmup_steps=5 ${TRAIN_ARGS:-} --out $OUT/$DAY-h200x2-train-check-125m.json"
  echo "$CMD" | tee "$OUT/issue8-train.cmd"
  timeout -k 10 "${TRAIN_BUDGET:-320}" $CMD 2>&1 | tee "$OUT/issue8-train.log" | grep -v "^WARNING" | tail -30
  echo "part 1 exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"
fi

if [[ " $PARTS " == *" cp "* ]]; then
  LEFT=$((540 - (SECONDS - START)))
  BUDGET=${CP_BUDGET:-$((LEFT > 120 ? LEFT : 120))}
  echo "== part 2: context-parallel KDA on 2 GPUs vs 1 GPU (budget $BUDGET s)"
  CMD="python3 benchmarks/bench_context_parallel.py --platform gpu --budget-s $BUDGET --job-timeout 240 \
--name h200x2-context-parallel-kda ${CP_ARGS:-} --out $OUT"
  echo "$CMD" | tee "$OUT/issue8-cp.cmd"
  timeout -k 10 $((BUDGET + 30)) $CMD 2>&1 | tee "$OUT/issue8-cp.log" | grep -v "^WARNING" | tail -40
  echo "part 2 exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"
fi
ls -la "$OUT"
