"""relaytrain: train a run spec, and list, inspect and export runs.

    relaytrain run --config SPEC.yaml [--set key=value ...] [--run-name NAME] [--result-json PATH]
        [--until-epoch N]                     pause after epoch N; the same command trains on
    relaytrain sweep --config SWEEP.yaml [--set key=value ...] [--name NAME]
                                              a sweep: trials of a spec, pruned (docs/sweeps.md)
    relaytrain sweep show SWEEP               the trials of a sweep, its best, what pruning saved
    relaytrain runs [STORAGE]                 the runs in a storage (default ./runs)
    relaytrain show RUN [--time]              attempts, checkpoints and metrics of one run
                                              (--time: where its step time went)
    relaytrain export RUN [--best | --latest | --step N] OUT.pt
    relaytrain sync RUN [--config SPEC.yaml [--set key=value ...] | --trust-stored-spec]
                                              log to MLflow what its tracking server missed

RUN is a run directory (runs/digits-cnn, s3://bucket/runs/NAME) or a run name under ./runs.
Everything but `run` reads the run directory alone: no Ray cluster, no Prefect server. None of
them imports code that only a file in storage names (docs/security.md): `sync` logs the best
model, which needs the spec's model builder, only given the spec (--config) or told to trust
the stored one (--trust-stored-spec).
Credentials for object storage come from the environment (AWS_*, ...), as for training.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from trainer_core import step_time, storage
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import stored_spec
from trainer_core.errors import RelaytrainError, SpecError
from trainer_core.run import catalog, epochs
from trainer_core.run.report import attempt_rows, epoch_table
from trainer_core.run.time_account import time_account


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    importable_from_working_directory()
    if args and args[0] == "run":  # flows.training owns run's options
        from flows.training import main as run_main

        return run_main(args[1:], prog="relaytrain run")
    if args and args[0] == "sweep":  # flows.sweep owns sweep's options
        from flows.sweep import main as sweep_main

        return sweep_main(args[1:], prog="relaytrain sweep")
    parser = _parser()
    parsed = parser.parse_args(args)
    if parsed.command is None:
        parser.print_help()
        return 2
    try:
        return int(parsed.handler(parsed) or 0)
    except (SpecError, RelaytrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def importable_from_working_directory() -> None:
    """The project's own modules that a spec names (model, transform, loop) import from the
    working directory, as under ``python -m``: a console script's ``sys.path`` starts at its
    own directory instead. (``ray.init`` adds the driver's working directory to its workers'.)"""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("run", help="train a spec (see `relaytrain run --help`)")
    commands.add_parser(
        "sweep", help="a sweep of trials of a spec, or `sweep show DIR` (`relaytrain sweep -h`)"
    )
    runs = commands.add_parser("runs", help="the runs in a storage, with status and size")
    runs.add_argument("storage", nargs="?", default="./runs", help="a run.storage path or URI")
    runs.set_defaults(handler=_runs)
    show = commands.add_parser("show", help="one run: attempts, checkpoints, metric table")
    show.add_argument("run", help="a run directory (path or URI) or a run name under ./runs")
    show.add_argument(
        "--time",
        action="store_true",
        help="where the time went: each part of a step per attempt and rank, goodput, "
        "stragglers and advice",
    )
    show.set_defaults(handler=_show)
    export = commands.add_parser("export", help="write a checkpoint's model as one .pt file")
    export.add_argument("run", help="a run directory (path or URI) or a run name under ./runs")
    export.add_argument("out", help="the file to write (a path or a storage URI)")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true", help="the best checkpoint (the default)")
    which.add_argument("--latest", action="store_true", help="the newest committed checkpoint")
    which.add_argument(
        "--step",
        type=int,
        help="the committed checkpoint at this step (a loop of your own: its report's number)",
    )
    export.set_defaults(handler=_export)
    sync = commands.add_parser("sync", help="log to MLflow what the tracking server missed")
    sync.add_argument("run", help="a run directory (path or URI) or a run name under ./runs")
    trust = sync.add_mutually_exclusive_group()
    trust.add_argument(
        "--config",
        help="the run's spec YAML: its model builder logs the best model (checked against the "
        "run's run.json)",
    )
    trust.add_argument(
        "--trust-stored-spec",
        action="store_true",
        help="import the code the run directory's run.json names, to log the best model (only "
        "for a run directory nobody else can write)",
    )
    sync.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --config"
    )
    sync.set_defaults(handler=_sync)
    return parser


def resolve_run(run: str) -> Any:
    """A run directory from what the user typed: a path or URI, else a name under ./runs."""
    if "://" not in run and "/" not in run and not storage.resolve(run).is_dir():
        run = f"./runs/{run}"
    return catalog.open_run(run)


# -- commands ---------------------------------------------------------------------------------


def _runs(args: argparse.Namespace) -> int:
    views, problems = catalog.list_runs(args.storage)
    rows = [
        {
            "run": v.name,
            "status": v.status,
            "steps": v.result.steps_completed,
            "epochs": _epochs(v),
            "attempts": len(v.result.attempts),
            "best": _best(v),
            "storage": _size(v.result.storage_bytes),
            "updated": time.strftime("%Y-%m-%d %H:%M", time.localtime(v.updated))
            if v.updated
            else "-",
        }
        for v in views
    ]
    if rows:
        print(_table(rows))
    else:
        print(f"no runs in {storage.resolve(args.storage).uri}")
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    run_dir = resolve_run(args.run)
    if args.time:
        return _show_time(run_dir)
    v = catalog.view(run_dir)
    result = v.result
    print(f"run {v.name}: {v.status}")
    print(f"  directory:  {v.uri} ({_size(result.storage_bytes)})")
    print(
        f"  steps:      {result.steps_completed}, epochs {_epochs(v)}"
        + (f", stopped early: {result.stop_reason}" if result.stop_reason else "")
    )
    if result.goodput is not None:
        print(
            f"  goodput:    {result.goodput:.3f} ({result.steps_completed} steps kept of "
            f"{result.steps_computed} computed)"
        )
    print(f"  best:       {_best(v)} at {result.best_checkpoint_uri or '-'}")
    if result.best_model_uri:
        print(f"  best model: {result.best_model_uri}")
    print("\nattempts")
    attempts = attempt_rows(result)  # each restart in place a row of its own
    print(_table(attempts) if attempts else "  none yet")
    print("\ncheckpoints")
    history = read_metrics_history(run_dir)
    ray_loop = bool(v.spec and v.spec.ray_loop)
    found = catalog.committed(run_dir)
    best_name = (result.best_checkpoint_uri or "").rstrip("/").rsplit("/", 1)[-1]
    shown = {k for c in found for k in c.metrics if k.startswith("val_") or k == v.best_metric}
    checkpoints = [
        {
            "step": c.step,
            "epochs done": epochs.epochs_done(c.metrics, history)
            if ray_loop
            else c.manifest.get("epoch", "-"),
            **{k: _number(c.metrics.get(k)) for k in sorted(shown)},
            "files": len(c.files),
            "size": _size(sum(int(e.get("size", 0)) for e in c.files.values())),
            "": "best" if c.name == best_name else "",
        }
        for c in found
    ]
    print(_table(checkpoints) if checkpoints else "  none committed")
    print("\nmetrics per epoch")
    table = epoch_table(history, ray_loop)
    print(_table([{k: _number(val) for k, val in row.items()} for row in table]) or "  none")
    return 0


def _show_time(run_dir: Any) -> int:
    """``show --time``: the breakdown per attempt and rank (ms per step), then the run's
    account of its time, stragglers and advice."""
    v = catalog.view(run_dir)
    history = read_metrics_history(run_dir)
    totals = step_time.per_rank(history)
    # A summary from before the breakdown, or a run still going: from the history.
    account = v.result.time or time_account(history, v.result.attempts, v.result.wall_time_s)
    print(f"run {v.name}: {v.status}, where the time went")
    if account is None or not totals:
        print("  no step was measured (a loop on Ray's own API reports no breakdown)")
        return 0
    print("\nms per step, by attempt and rank")
    rows = [
        {
            "attempt": attempt,
            "rank": rank,
            "steps": steps,
            "step": f"{1000 * figures[0] / steps:.2f}",
            **{
                name: f"{1000 * figures[1 + i] / steps:.2f}"
                for i, name in enumerate(step_time.PARTS)
            },
        }
        for (attempt, rank), (steps, figures) in totals.items()
    ]
    print(_table(rows))
    share = account.productive_share
    r = account.restarts
    print("\ntime")
    print(
        f"  productive:   {account.productive_s:.1f} s of {account.wall_s:.1f} s wall"
        + (f" ({share:.1%})" if share is not None else "")
    )
    print(f"  data wait:    {account.data_wait_s:.1f} s")
    print(f"  checkpoints:  {account.checkpoint_blocked_s:.1f} s blocked")
    print(f"  validation:   {account.validation_s:.1f} s")
    print(
        f"  restarts:     {r.total_s:.1f} s (detection {r.detection_s:.1f}, new groups "
        f"{r.new_group_s:.1f}, recomputed steps {r.recompute_s:.1f})"
    )
    print(f"  the rest:     {account.overhead_s:.1f} s (start-up, restore, finishing)")
    for s in account.stragglers:
        print(
            f"  straggler:    rank {s['rank']} on node {s['node']} (attempt {s['attempt']}): "
            f"{s['ratio']:.2f}x its peers' median, {s['windows']} windows from step "
            f"{s['from_step']}"
        )
    for line in account.advice:
        print(f"  advice:       {line}")
    return 0


def _export(args: argparse.Namespace) -> int:
    run_dir = resolve_run(args.run)
    which: Any = args.step if args.step is not None else ("latest" if args.latest else "best")
    checkpoint = catalog.choose_checkpoint(run_dir, which)
    where, size = catalog.export_model(run_dir, checkpoint, args.out)
    print(
        f"wrote {where} ({_size(size)}): the model of {checkpoint.uri}; load it with "
        "torch.load(path, weights_only=True)"
    )
    return 0


def _sync(args: argparse.Namespace) -> int:
    from trainer_core.run.summary import sync_tracking
    from trainer_core.tracking.mlflow_state import read_state

    run_dir = resolve_run(args.run)
    spec = None
    if args.config:
        from trainer_core.spec.overrides import load_spec

        spec = load_spec(args.config, args.set)
        run_dir.check_compatible(spec.identity(), spec.fingerprint())
    elif args.set:
        raise SpecError("--set is given with --config only", field="--set")
    elif args.trust_stored_spec:
        spec = stored_spec(run_dir)
    _, tracker = sync_tracking(spec, run_dir)
    state = read_state(run_dir)
    print(state.describe() if state else "nothing logged")
    if tracker.model_not_logged:
        print(f"the best model is not logged: {tracker.model_not_logged}")
    return 0 if state is not None and state.pending is None else 1


# -- formatting -------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join("  " + line for line in lines)


def _best(v: catalog.RunView) -> str:
    value = v.best_value
    return f"{v.best_metric} {_number(value)}" if value is not None else "-"


def _epochs(v: catalog.RunView) -> str:
    target = v.result.target_epochs
    return f"{v.result.epochs_completed}/{target}" if target else str(v.result.epochs_completed)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _size(n: int | None) -> str:
    n = n or 0
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
