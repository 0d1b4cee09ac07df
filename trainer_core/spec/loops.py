"""Which loop a spec runs, and the sections each needs: the built-in loop (``model``, ``data``,
``schedule``), a Ray Train loop of the user's own (``train_loop``; the built-in sections are
ignored, with a warning), or a loop of the user's own on relaytrain's API (``train_loop_api:
relaytrain``: ``data`` and ``schedule``, for the stream it reads). ``spec`` is the
``RunSpec`` being validated."""

from __future__ import annotations

import warnings
from typing import Any

from trainer_core.errors import SpecError


def check_loop_sections(spec: Any) -> None:
    """The built-in loop needs its sections; a user's loop ignores them (and says so)."""
    if spec.train_loop is None and spec.train_loop_api != "ray":
        raise SpecError(
            f"train_loop_api={spec.train_loop_api!r} says what a loop of your own is "
            "written against, but train_loop is not set: set train_loop, or drop "
            "train_loop_api",
            field="train_loop_api",
        )
    if spec.own_loop:
        _check_own_loop_sections(spec)
        return
    if spec.train_loop is None and spec.datasets:
        raise SpecError(
            f"datasets {sorted(spec.datasets)} feed a Ray Train loop of your own "
            "(ray.train.get_dataset_shard): set train_loop, or give the built-in loop its "
            "data with data.dataset",
            field="datasets",
        )
    if spec.train_loop is None:
        missing = [s for s in ("model", "data", "schedule") if getattr(spec, s) is None]
        if missing:
            raise ValueError(
                f"section(s) {missing} are required by the built-in training loop "
                "(or name your own Ray Train loop with train_loop)"
            )
        return
    _refuse_held_out_sets(spec)
    _say_ignored(
        spec,
        ("model", "data", "schedule"),
        "train_loop is set, so {} are ignored: pass what your loop needs through train_loop_config",
    )


def check_batch_size(spec: Any) -> None:
    """Every worker needs a sample of the global batch."""
    workers = spec.scaling.max_workers
    if spec.data.batch_size < workers:
        raise SpecError(
            f"data.batch_size={spec.data.batch_size} is the global batch, shared by "
            f"scaling.num_workers={workers} workers: each needs a sample. Raise "
            f"data.batch_size to at least {workers}, or use fewer workers.",
            field="data.batch_size",
        )


def _check_own_loop_sections(spec: Any) -> None:
    """A loop on relaytrain's API reads ``data`` for ``schedule.epochs`` and
    ``optimizer.grad_accumulation`` (the batches of each of its steps); it builds its own
    model, optimizer and loss (ignored, with a warning)."""
    missing = [s for s in ("data", "schedule") if getattr(spec, s) is None]
    if missing:
        raise SpecError(
            f"train_loop_api=relaytrain streams the run's data: section(s) {missing} are "
            "required (data.dataset and schedule.epochs), or set train_loop_api ray",
            field=missing[0],
        )
    check_batch_size(spec)
    if spec.schedule.early_stopping is not None:
        raise SpecError(
            "schedule.early_stopping is the built-in loop's: your loop decides when to stop "
            "(return from it) and records why in its reports; drop schedule.early_stopping",
            field="schedule.early_stopping",
        )
    if spec.schedule.scheduler is not None:
        raise SpecError(
            f"schedule.scheduler {spec.schedule.scheduler!r} is the built-in loop's: your loop "
            "builds its scheduler and steps it itself, and hands it to "
            "session().setup(model, optimizer, scheduler), which checkpoints it; drop "
            "schedule.scheduler",
            field="schedule.scheduler",
        )
    schedule = spec.schedule
    for key, set_ in (
        ("lr_schedule", schedule.lr_schedule != "constant"),
        ("warmup_steps", schedule.warmup_steps > 0),
    ):
        if set_:
            raise SpecError(
                f"schedule.{key}={getattr(schedule, key)!r} shapes the built-in loop's learning "
                "rate, which your loop sets itself: build its scheduler in your loop (warm-up "
                "included) and hand it to session().setup(model, optimizer, scheduler), which "
                f"checkpoints it; drop schedule.{key}",
                field=f"schedule.{key}",
            )
    _say_ignored(
        spec,
        ("model",),
        "train_loop is your own loop, so {} are ignored: build them in your loop "
        "(train_loop_config passes it settings)",
        optimizer_read=("grad_accumulation",),
    )


def _refuse_held_out_sets(spec: Any) -> None:
    """A Ray loop's validation and test sets are its own to evaluate: relaytrain scores its
    held-out sets on checkpoints it reads, and a Ray loop's are in the loop's own format, so
    such a set would never be scored (a warning would be read as a promise kept)."""
    held = [k for k in ("validation", "test") if spec.data is not None and getattr(spec.data, k)]
    if held:
        raise SpecError(
            f"data.{held[0]} {getattr(spec.data, held[0])!r} is a set relaytrain evaluates on "
            "checkpoints it can read, but a Ray Train loop of your own (train_loop_api: ray) "
            f"saves them in its own format, so it would never be scored: evaluate it in your "
            "loop (build the set there, its path or kwargs through train_loop_config) and "
            "report its figures with ray.train.report; drop "
            f"{', '.join(f'data.{k}' for k in held)}",
            field=f"data.{held[0]}",
        )


def _say_ignored(
    spec: Any, sections: tuple[str, ...], message: str, optimizer_read: tuple[str, ...] = ()
) -> None:
    """Warn of the ``sections`` and settings a loop of the user's own does not read: of the
    optimizer section (always there, with defaults), the keys the spec sets but the loop does
    not read (it builds its own optimizer)."""
    ignored = [s for s in sections if getattr(spec, s) is not None]
    ignored += [
        f"optimizer.{key}"
        for key in sorted(spec.optimizer.model_fields_set)
        if key not in optimizer_read
    ]
    if spec.precision != "fp32":
        ignored.append(f"precision={spec.precision}")  # your loop autocasts itself
    ignored += [key for key in ("loss", "metrics") if getattr(spec, key)]
    if ignored:
        warnings.warn(message.format(ignored), UserWarning, stacklevel=5)
