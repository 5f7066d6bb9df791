#!/usr/bin/env bash
# Runs an ablation grid with N parallel workers on one machine (e.g. the lent H200: 16 CPU cores compile in
# parallel, the tiny models share the GPU), then collects the results.
#   bash experiments/run_grid_device.sh CONFIG WORKERS RUNS_DIR OUT [--set KEY=VALUE ...]
set -u
config=$1; workers=$2; runs=$3; out=$4; shift 4
py=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
pids=()
for ((i = 0; i < workers; i++)); do
  $py -m lineattn.experiments.ablate --config "$config" --runs-dir "$runs" --out "$out.shard$i" \
      --shard "$i/$workers" "$@" > "$runs.worker$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
rm -rf "$out".shard*
$py -m lineattn.experiments.ablate --config "$config" --runs-dir "$runs" --out "$out" --report-only "$@"
