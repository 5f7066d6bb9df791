#!/usr/bin/env bash
# Runs the unfinished cells of an ablation grid on one machine (the lent H200: 16 CPU cores compile in parallel,
# the tiny models share the GPU) within a deadline, and packs what came out into $OUT.
#
#   bash experiments/run_grid_device.sh CONFIG GLOBS [--set KEY=VALUE ...]
#   bash experiments/run_grid_device.sh mqar|lm [--set ...]      (a shipped config's runs but the per-element rows)
#   bash experiments/run_grid_device.sh mqar-element|lm-element   (its per-element rows alone: a call of their own)
#
#   CONFIG  configs/ablate_<name>.yaml; the committed runs in experiments/results/<name>/runs count as done
#           (`ablate --list` says done; runs finished with another config, "other", are not redone either)
#   GLOBS   comma-separated cell globs (setting/row/lrX/seedN) in priority order: the cells of the first glob are
#           queued first; cells already done are left out
#   env     WORKERS (2) processes x THREADS (6) threads taking seed groups from one queue (`ablate --claim
#           --threads`): the driver time-slices processes on one GPU (2026-12-01, 12 single-run processes: every
#           LM run at 82-85 K tokens/s, 12 x that is the 1.1 M tokens/s a run's log reached when it ran
#           nearly alone), while the threads of one process share its context (2 x 6 threads: 18 LM runs in 326 s,
#           62-440 K tokens/s a run; give the per-element rows a call of their own, see experiments/README.md); DEADLINE (480):
#           seconds after this script's start at which unfinished workers are stopped (the script ends about
#           15 s later); OUT (required: the folder that comes back); RUNS (/tmp/ablate_runs_<config name>); PYTHON (python3);
#           CLOSE (120): no run starts in the last CLOSE seconds; DRY=1: print the queue and stop
#
# $OUT receives: runs.tgz (every finished run: <key>/{result.json,metrics.jsonl}, to unpack into
# experiments/results/<name>/runs), partial.tgz (metrics.jsonl of runs stopped at the deadline: their speed),
# table.md (the new runs alone) and log.txt (the queue, every worker's log, timings). Checkpoints are off
# (train.checkpoint_every=0): a run stopped at the deadline starts again from step 0 in a later call.
# Afterwards, here:
#   tar -xzf <files>/runs.tgz -C experiments/results/<name>/runs
#   python -m lineattn.experiments.ablate --config CONFIG --runs-dir experiments/results/<name>/runs \
#       --out experiments/results/<name> --report-only
set -u
# The per-element rows (token-level recurrences, 5-10x another row's run) get calls of their own: 16 of them
# beside each other finished none in 530 s; 4 LM additive-element runs alone took 120 s each (2026-12-01).
# Seed 0 and seed 1 sit under separate globs, so they are separate groups that run side by side; the other rows
# keep the seeds of a cell together (one compile for both), in grid order.
element=*/*-element/*/seed0,*/*-element/*/seed1
rest=*/*-none/*,*/*-fixed/*,*/*-head/*,*/*-channel/*,*/attention/*
case $1 in
  mqar|lm) config=configs/ablate_$1.yaml; shift; globs=$rest;;
  mqar-element|lm-element) config=configs/ablate_${1%-element}.yaml; shift; globs=$element;;
  *)    config=$1; globs=$2; shift 2;;
esac
: "${OUT:?set OUT to the folder that comes back}"
name=$(basename "$config" .yaml)
workers=${WORKERS:-2}; threads=${THREADS:-6}; deadline=${DEADLINE:-480}; runs=${RUNS:-/tmp/ablate_runs_$name}; py=${PYTHON:-python3}
done_dir=experiments/results/$name/runs
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# One compile per model: the seeds of a group run one after another in one worker and find the train step in
# the persistent cache (the lr is a constant of the compiled step, the seed is not).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/lineattn_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
# A model's first run took 100-230 s where a second seed (its compile cached) took 20-40 s. XLA's autotuning
# (timing candidate GEMM/fusion kernels on the shared GPU) is part of each compile: off, as these models are too
# small for the chosen algorithm to matter (its share of the compile time was not measured).
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"
t0=$(date +%s)
rm -rf "${runs}_report"*; mkdir -p "$OUT" "$runs"
# a run stopped in an earlier call on this machine has no checkpoint: it starts again from step 0
(cd "$runs" && find . -name config.yaml -printf '%h\n' | while read -r d; do [ -f "$d/result.json" ] || rm -rf "$d"; done)
log=$OUT/log.txt
{ echo "# $(date -u +%FT%TZ) $config workers=$workers threads=$threads deadline=${deadline}s"; nvidia-smi -L 2>/dev/null
  $py -c 'import jax; print("jax", jax.__version__, jax.devices())'; } > "$log" 2>&1

# The queue: the selected cells not yet done in the committed results, in the order of the globs.
todo=$($py -m lineattn.experiments.ablate --config "$config" --runs-dir "$done_dir" --only "$globs" --list "$@" \
       | awk '$1 == "todo" {print $2}' | paste -sd, -)
if [ -z "$todo" ]; then echo "nothing to do" | tee -a "$log"; exit 0; fi
echo "# queue ($(tr ',' '\n' <<< "$todo" | wc -l) runs): $todo" >> "$log"
if [ -n "${DRY:-}" ]; then tr ',' '\n' <<< "$todo"; exit 0; fi
rm -rf "$runs/.claims"; mkdir -p "$runs/.claims"
left=$(( deadline - ($(date +%s) - t0) ))
echo "# $workers workers x $threads threads, stopped after $left s" >> "$log"
pids=()
for ((i = 0; i < workers; i++)); do
  timeout -k 10 "$left" $py -m lineattn.experiments.ablate --config "$config" --runs-dir "$runs" \
      --out "${runs}_report$i" --only "$todo" --claim --threads "$threads" --set train.checkpoint_every=0 "$@" > "$runs/worker$i.log" 2>&1 &
  pids+=($!)
done
# No new run starts in the last CLOSE seconds: the runs in flight get the GPU to themselves and finish in time.
(sleep $(( left > ${CLOSE:-120} ? left - ${CLOSE:-120} : 0 )); touch "$runs/.claims/closed") & closer=$!
for p in "${pids[@]}"; do wait "$p"; done
pkill -P "$closer" 2>/dev/null; kill "$closer" 2>/dev/null
echo "# workers finished after $(( $(date +%s) - t0 )) s" >> "$log"

$py -m lineattn.experiments.ablate --config "$config" --runs-dir "$runs" --out "${runs}_report" --report-only \
    --set train.checkpoint_every=0 "$@" >> "$log" 2>&1
cp "${runs}_report/table.md" "$OUT/table.md" 2>/dev/null
for f in "$runs"/worker*.log; do echo "## $f"; cat "$f"; done >> "$log"
(cd "$runs" && find . -name result.json -printf '%h\n' | sort > .finished
 find . -name metrics.jsonl -printf '%h\n' | sort | comm -23 - .finished > .partial
 sed 's|$|/result.json|' .finished > .files; sed 's|$|/metrics.jsonl|' .finished >> .files
 tar -czf "$OUT/runs.tgz" -T .files
 sed 's|$|/metrics.jsonl|' .partial | tar -czf "$OUT/partial.tgz" -T -
 echo "# finished $(wc -l < .finished), stopped at the deadline $(wc -l < .partial):" $(cat .partial)) >> "$log"
echo "# done after $(( $(date +%s) - t0 )) s" >> "$log"
tail -n 3 "$log"
