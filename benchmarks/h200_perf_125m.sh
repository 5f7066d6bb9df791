#!/usr/bin/env bash
# The H200 run for issue [train]: training throughput and MFU of configs/hybrid_125m.yaml (bf16 compute).
# Run through the device tool with `.whl` carried (pyyaml and tqdm wheels); writes into $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${PERF_TIMEOUT:-170} python3 scripts/perf.py --config configs/hybrid_125m.yaml --device gpu --steps 5 \
  --set model.backend=${BACKEND:-chunk} --out $OUT/perf_125m_${BACKEND:-chunk}.json 2>&1 | tee $OUT/perf_125m.log | tail -25
