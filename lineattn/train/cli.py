"""`lineattn` command-line tool: train, eval, generate, fetch-data.

    lineattn train --config configs/tiny.yaml [--set train.steps=50 ...] [--run-dir runs/tiny] [--resume-step N]
    lineattn eval --run-dir runs/tiny [--step N] [--set data.eval_rows=...]
    lineattn generate --run-dir runs/tiny --prompt "ROMEO." [--max-new-tokens 200] [--temperature 0.8] [--top-k 40]
    lineattn fetch-data [--cache-dir data]
    lineattn ablate ...          (lineattn.experiments.ablate, when present)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lineattn", description="Train, evaluate and sample lineattn language models.",
                                epilog="Also: `lineattn ablate --help` (the gate-granularity ablation runner).")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) a run")
    t.add_argument("--config", help="YAML or TOML config file (default: the run dir's config.yaml when resuming)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set model.width=512 (repeatable)")
    t.add_argument("--run-dir", help="run directory (default: runs/<config name>); an existing one is resumed")
    t.add_argument("--resume-step", type=int, help="resume from this checkpoint instead of the latest "
                                                   "(later ones are moved to checkpoints_set_aside/)")
    t.add_argument("--stop-at", type=int, help="stop after this step, as if interrupted (for testing resume)")

    e = sub.add_parser("eval", help="evaluate a run's checkpoint on its validation data")
    e.add_argument("--run-dir", required=True)
    e.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--max-rows", type=int, help="validation rows (default: all for text, data.eval_rows otherwise)")

    g = sub.add_parser("generate", help="sample text from a run's checkpoint (byte-level models)")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--step", type=int)
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-samples", type=int, default=1)

    f = sub.add_parser("fetch-data", help="download the Shakespeare corpus into the data cache")
    f.add_argument("--cache-dir", default="data")
    return p


def _maybe_distributed(cfg) -> None:
    """Multi-host (`mesh.distributed: true`): `jax.distributed.initialize` before JAX touches a device.

    JAX finds the coordinator, process count and id by itself under Slurm, Open MPI and on TPU pods; elsewhere set
    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every host.
    """
    if cfg is None or not cfg.mesh.distributed:
        return
    import jax
    env = os.environ
    jax.distributed.initialize(
        coordinator_address=env.get("JAX_COORDINATOR_ADDRESS"),
        num_processes=int(env["JAX_NUM_PROCESSES"]) if env.get("JAX_NUM_PROCESSES") else None,
        process_id=int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID") else None)


def cmd_train(args) -> int:
    from lineattn.train.config import load_config
    from lineattn.train.trainer import format_record, train
    cfg_path = args.config
    if cfg_path is None:
        if args.run_dir and (Path(args.run_dir) / "config.yaml").exists():
            cfg_path = Path(args.run_dir) / "config.yaml"
        else:
            raise SystemExit("lineattn train: --config is required for a new run")
    cfg = load_config(cfg_path, args.overrides)
    run_dir = args.run_dir or os.path.join("runs", Path(cfg_path).stem)
    _maybe_distributed(cfg)
    last = train(cfg, run_dir, until=args.stop_at, resume_step=args.resume_step)
    if last and "val_loss" in last:
        print("final: " + format_record(last, cfg.train.steps), flush=True)
    print(f"run directory: {run_dir}", flush=True)
    return 0


def cmd_eval(args) -> int:
    from lineattn.train.data import make_source
    from lineattn.train.trainer import evaluate_model, load_run
    cfg, bundle, meta = load_run(args.run_dir, step=args.step, overrides=tuple(args.overrides))
    source = make_source(cfg.data)
    max_rows = args.max_rows if args.max_rows else (None if source.kind == "text" else cfg.data.eval_rows)
    out = evaluate_model(bundle.model, source, batch_size=cfg.data.batch_size, max_rows=max_rows)
    print(json.dumps({"step": meta["step"], **out}), flush=True)
    return 0


def cmd_generate(args) -> int:
    import jax
    import numpy as np
    from lineattn.decode import generate
    from lineattn.train.tokenizer import ByteTokenizer
    from lineattn.train.trainer import load_run
    cfg, bundle, meta = load_run(args.run_dir, step=args.step)
    if cfg.data.source != "shakespeare":
        raise SystemExit(f"lineattn generate: the run was trained on {cfg.data.source!r}, not byte-level text")
    tok = ByteTokenizer()
    prompt = np.tile(tok.encode(args.prompt, bos=True)[None], (args.num_samples, 1))
    out = np.asarray(generate(bundle.model, prompt, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, rng=jax.random.key(args.seed)))
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} (step {meta['step']}) ---")
        print(args.prompt + tok.decode(out[i, prompt.shape[1]:]), flush=True)
    return 0


def cmd_fetch_data(args) -> int:
    from lineattn.train.corpus import fetch_shakespeare
    path = fetch_shakespeare(args.cache_dir)
    print(path)
    return 0


# Subcommands that live in other packages: name -> module with a `main(argv) -> int`.
EXTERNAL = {"ablate": "lineattn.experiments.ablate"}


def main(argv: list[str] | None = None) -> int:
    import importlib
    from lineattn.train.checkpoint import CheckpointError
    from lineattn.train.config import ConfigError
    from lineattn.train.trainer import DivergedError
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in EXTERNAL:
        try:
            module = importlib.import_module(EXTERNAL[argv[0]])
        except ImportError as e:
            print(f"lineattn {argv[0]}: not available ({e})", file=sys.stderr)
            return 2
        return module.main(argv[1:])
    args = _parser().parse_args(argv)
    handlers = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "fetch-data": cmd_fetch_data}
    try:
        return handlers[args.command](args)
    except ConfigError as e:
        print(f"lineattn {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"lineattn {args.command}: checkpoint error: {e}", file=sys.stderr)
        return 3
    except DivergedError as e:
        print(f"lineattn {args.command}: training diverged: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
