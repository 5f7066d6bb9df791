#!/usr/bin/env bash
# The H200 run for issue 2 (Pallas kernels): the pallas tests compiled on the GPU, then bench_pallas_kda.py
# (lineattn-pallas beside jax-linear-attention's Mosaic GPU kernels and FLA, same inputs). Run through the device
# tool with `.whl` carried (see ../shared/BENCHMARKING.md); writes into $OUT. BENCH_ARGS overrides the bench flags.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider tests/test_pallas.py tests/test_pallas_gpu.py ${TESTS_K:+-k "$TESTS_K"} \
    2>&1 | tee $OUT/gpu_tests.log | grep -v "^$" | tail -12
fi
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_pallas_kda.py --out $OUT ${BENCH_ARGS:---tune --gdn --fla fwd \
  --skip lineattn-chunk --long 262144} 2>&1 | grep -v "slow_operation_alarm\|Constant folding\|^$" | tee $OUT/bench.log
