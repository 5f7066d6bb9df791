#!/usr/bin/env bash
# The H200 run for the ops core: GPU correctness tests, then KDA timed beside jax-linear-attention and FLA.
# Run through the device tool with `.whl` carried (see ../shared/BENCHMARKING.md); writes into $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
LINEATTN_SHARED=$PWD/.shared_copy timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fla_reference.py tests/test_backends.py \
  -k "${TESTS_K:-kda or gdn or deltanet}" 2>&1 | tee $OUT/gpu_tests.log | tail -5
timeout 420 python3 benchmarks/bench_kda.py --device gpu --B 8 --T 4096 --H 16 --K 128 --V 128 \
  --dtype bfloat16 --skip lineattn-recurrent ${BENCH_SKIP:-} --out $OUT 2>&1 | tee $OUT/bench.log
