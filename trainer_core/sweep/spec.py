"""A sweep spec: a run spec with a ``sweep:`` section, validated whole at setup.

    run: {name: digits-lr, storage: ./runs}
    ...                                   # the run spec every trial starts from
    sweep:
      trials: 6
      concurrent: 2                       # trials at once (default: what the cluster holds)
      metric: val_loss                    # a metric every trial records
      direction: minimize                 # known for loss, val_loss, val_perplexity, val_accuracy
      sampler: random                     # random | grid | qmc | tpe
      pruner: {successive_halving: {reduction_factor: 2}}   # none | median | hyperband: {...}
      seed: 7
      study_url_env: OPTUNA_STUDY_URL     # also keep the study in this database (optional)
      space:
        optimizer.lr: {log_uniform: [1.0e-4, 1.0e-1]}
        model.kwargs.hidden: {choice: [[32], [64, 64]]}

Trial ``n`` is the run ``<run.name>-t<nnn>`` under the same ``run.storage``: the base spec with
the trial's values set at their keys (``trial_spec``). Every bad input is refused here, before
any trial starts, naming its key: an unknown key in the space (or one a trial may not set), a
distribution that cannot be sampled, a value at the space's edges that the run spec refuses, a
metric the trials' loop never records, a sampler or pruner Optuna does not have or will not
build with the arguments given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from pydantic import Field, ValidationError, field_validator

from trainer_core.errors import SpecError
from trainer_core.spec.overrides import (
    apply_override,
    build_spec,
    error_field,
    format_validation_error,
    read_yaml,
)
from trainer_core.spec.run_spec import RunSpec
from trainer_core.spec.sections import MAX_SEED, _Section, validate_run_name
from trainer_core.sweep.space import Dimension, parse_space

SAMPLERS = ("random", "grid", "qmc", "tpe")
PRUNERS = {
    "successive_halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "median": "MedianPruner",
}
#: Keys a trial may not set: where the sweep's trials live and what they are called.
FIXED_KEYS = {
    "run.name": "each trial is named <run.name>-t<nnn> after the sweep",
    "run.storage": "the sweep's trials live under its run.storage",
    "run.credentials": "the sweep's storage has one set of credentials",
}
#: The direction of the metrics whose better side is known.
DIRECTIONS: dict[str, Literal["minimize", "maximize"]] = {
    "loss": "minimize",
    "val_loss": "minimize",
    "val_perplexity": "minimize",
    "val_accuracy": "maximize",
}
#: A trial's run name: ``<sweep name>-t<nnn>`` within the 100 characters of a run name.
TRIAL_SUFFIX = "-t{:03d}"
MAX_TRIALS = 999


class SweepSection(_Section):
    #: The search space: dotted keys of the run spec -> distributions (``sweep.space``).
    space: dict[str, Any]
    trials: int = Field(ge=1, le=MAX_TRIALS)
    #: Trials that run at once; None: as many as the cluster holds.
    concurrent: int | None = Field(default=None, ge=1)
    metric: str
    direction: Literal["minimize", "maximize"] | None = None
    sampler: Literal["random", "grid", "qmc", "tpe"] = "random"
    #: ``none``, a pruner's name, or ``{name: {argument: value}}`` (Optuna's arguments).
    pruner: str | dict[str, dict[str, Any] | None] = "none"
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    #: The name of an environment variable holding the URL of a database the study is kept in
    #: as well (trainer_core/sweep/study.py); the URL itself never enters the spec.
    study_url_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @field_validator("pruner")
    @classmethod
    def _pruner(cls, value: Any) -> Any:
        name = value if isinstance(value, str) else next(iter(value), None)
        if (isinstance(value, dict) and len(value) != 1) or (
            name != "none" and name not in PRUNERS
        ):
            raise SpecError(
                f"sweep.pruner {value!r} is not a pruner: use none, "
                f"{', '.join(PRUNERS)}, or {{name: {{argument: value}}}} with one of them",
                field="pruner",
            )
        return value


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: its settings, its space and the run spec its trials start from."""

    name: str
    section: SweepSection
    #: The space's dimensions, by key.
    dimensions: tuple[Dimension, ...]
    #: The run spec as written (plain data), which each trial's values are set into.
    base: dict[str, Any]
    direction: Literal["minimize", "maximize"]
    #: The epochs every trial trains (the base spec's; a pruner's rungs are counted in them).
    epochs: int = 0

    def trial_name(self, number: int) -> str:
        return self.name + TRIAL_SUFFIX.format(number)

    def trial_spec(self, number: int, values: Mapping[str, Any]) -> RunSpec:
        """Trial ``number``'s run spec: the base with ``values`` (dotted key -> value) set."""
        raw = json.loads(json.dumps(self.base))
        for key, value in values.items():
            apply_override(raw, key.split("."), value)
        raw.setdefault("run", {})["name"] = self.trial_name(number)
        return build_spec(raw)

    def pruner_name(self) -> str:
        value = self.section.pruner
        return value if isinstance(value, str) else next(iter(value))

    def pruner_arguments(self) -> dict[str, Any]:
        """The pruner's arguments as Optuna takes them: as written, with successive halving's
        and hyperband's first rung at epoch 1 and hyperband's budget the sweep's epochs unless
        set (Optuna's ``auto`` guesses them from the trials that finish first, which timing
        decides)."""
        value = self.section.pruner
        arguments = {} if isinstance(value, str) else dict(value[self.pruner_name()] or {})
        if self.pruner_name() in ("successive_halving", "hyperband"):
            arguments.setdefault("min_resource", 1)
        if self.pruner_name() == "hyperband":
            arguments.setdefault("max_resource", self.epochs)
        return arguments

    def pruner(self) -> Any:
        """The Optuna pruner the section names (``NopPruner`` for none)."""
        name = self.pruner_name()
        if name == "none":
            return optuna.pruners.NopPruner()
        return getattr(optuna.pruners, PRUNERS[name])(**self.pruner_arguments())


def load_sweep(path: str | Path, name: str | None = None) -> Sweep:
    """The sweep spec in the YAML file at ``path`` (``name`` over its ``run.name``)."""
    return build_sweep(read_sweep_file(path), name)


def read_sweep_file(path: str | Path) -> Any:
    """The sweep file at ``path`` as plain data: a run spec with a ``sweep:`` section, or a
    file that names its run spec (``spec: digits_cnn.yaml``, relative to the file), whose
    sections it then updates key by key (``run: {name: ...}`` sets the name, keeps the rest)."""
    raw = read_yaml(path, "sweep")
    if not isinstance(raw, dict) or "spec" not in raw:
        return raw
    named = raw["spec"]
    if not isinstance(named, str) or not named:
        raise SpecError(
            f"spec {named!r}: name the run spec file the sweep starts from, e.g. "
            "spec: digits_cnn.yaml (relative to the sweep file)",
            field="spec",
        )
    base = read_yaml(Path(path).parent / named, "run spec")
    if not isinstance(base, dict):
        raise SpecError(f"spec {named!r} holds no run spec (a mapping)", field="spec")
    for key, value in raw.items():
        if key == "spec":
            continue
        section = base.get(key)
        base[key] = (
            {**section, **value} if isinstance(section, dict) and isinstance(value, dict) else value
        )
    return base


def build_sweep(raw: Any, name: str | None = None) -> Sweep:
    """A run spec mapping with a ``sweep:`` section, validated into a Sweep or SpecError."""
    if not isinstance(raw, dict) or "sweep" not in raw:
        raise SpecError(
            "a sweep spec is a run spec with a sweep: section (trials, metric, space): "
            "add one, or run a single training with `relaytrain run`",
            field="sweep",
        )
    base = {key: value for key, value in raw.items() if key != "sweep"}
    try:
        section = SweepSection.model_validate(raw["sweep"])
    except ValidationError as e:
        field = error_field(e.errors()[0], "sweep") if e.errors() else "sweep"
        raise SpecError(format_validation_error(e, "sweep"), field=field) from e
    spec = build_spec(base)
    sweep_name = name or spec.run.name
    if sweep_name is None:
        raise SpecError(
            "a sweep needs a name: set run.name (or --name); its trials are the runs "
            "<name>-t001, <name>-t002, ..., and running the sweep again finds them by it",
            field="run.name",
        )
    validate_run_name(sweep_name + TRIAL_SUFFIX.format(section.trials))
    direction = section.direction or DIRECTIONS.get(section.metric)
    if direction is None:
        raise SpecError(
            f"sweep.direction: say whether {section.metric!r} is better lower or higher: "
            "direction: minimize, or direction: maximize",
            field="sweep.direction",
        )
    epochs = spec.schedule.epochs if spec.schedule else 0
    # by key: a sampler draws the keys in turn, so the order they were written in (which a
    # YAML dump or a dict merge may change) must not choose the values
    dimensions = tuple(sorted(parse_space(section.space), key=lambda d: d.key))
    sweep = Sweep(sweep_name, section, dimensions, base, direction, epochs)
    _check_metric(sweep, [spec, *(s for d in sweep.dimensions for s in _edge_specs(sweep, d))])
    _check_sampler(sweep)
    _check_pruner(sweep, spec)
    try:
        sweep.pruner()
    except (TypeError, ValueError) as e:
        raise SpecError(
            f"sweep.pruner {section.pruner!r}: Optuna refuses it: {e}", field="sweep.pruner"
        ) from e
    return sweep


def _edge_specs(sweep: Sweep, dimension: Dimension) -> list[RunSpec]:
    """The trial specs at the dimension's edges (alone: the other keys at the base's values);
    a key a trial may not set, an unknown key, or a value the spec refuses names the space's
    key."""
    field = f"sweep.space.{dimension.key}"
    for fixed, why in FIXED_KEYS.items():
        if dimension.key == fixed or dimension.key.startswith(fixed + "."):
            raise SpecError(f"{field}: a trial may not set {fixed}: {why}", field=field)
    specs = []
    for value in dimension.corners():
        try:
            specs.append(sweep.trial_spec(0, {dimension.key: value}))
        except SpecError as e:
            raise SpecError(f"{field} = {value!r}: {e}", field=field) from e
    return specs


def _check_metric(sweep: Sweep, specs: list[RunSpec]) -> None:
    """The built-in loop records a known set of metrics, whatever the space sets (validation
    may be one of its keys): the sweep's metric must be among them in ``specs`` (the base and
    every edge). A loop of one's own reports what it likes; its first report without the
    metric fails the trial."""
    for each in specs:
        if each.train_loop is not None:
            continue
        recorded = each.builtin_metrics()
        if sweep.section.metric not in recorded:
            raise SpecError(
                f"sweep.metric {sweep.section.metric!r} is not recorded by every trial (the "
                f"built-in loop records {recorded} for a spec of this sweep; val_* need "
                f"data.validation_fraction > 0 or data.validation)",
                field="sweep.metric",
            )


def _check_pruner(sweep: Sweep, spec: RunSpec) -> None:
    """A pruner the sweep can ask at fixed epochs: the built-in loop (which pauses at an
    epoch), every trial the same epochs, rungs given in epochs (not Optuna's ``auto``), and no
    TPE beside successive halving (which ends no trial before every trial reached its first
    rung, so TPE would learn from none)."""
    name = sweep.pruner_name()
    if name == "none":
        return
    if spec.train_loop is not None:
        raise SpecError(
            f"sweep.pruner {name}: a pruned trial pauses after an epoch, which only the "
            "built-in loop can do (a loop of one's own decides its own stops): use pruner: none",
            field="sweep.pruner",
        )
    for d in sweep.dimensions:
        if d.key == "schedule.epochs":
            raise SpecError(
                f"sweep.space.schedule.epochs: with pruner {name} every trial trains the same "
                "epochs (the pruner's rungs are counted in them): remove it from the space, or "
                "use pruner: none",
                field="sweep.space.schedule.epochs",
            )
    arguments = sweep.pruner_arguments()
    for key in ("min_resource", "max_resource"):
        if arguments.get(key) == "auto":
            raise SpecError(
                f"sweep.pruner: {name}'s {key} 'auto' is guessed from the trials that finish "
                "first, so the rungs would depend on timing: give it in epochs (min_resource: "
                "1 and max_resource: the run's epochs are the defaults here)",
                field="sweep.pruner",
            )
    if name in ("successive_halving", "hyperband") and sweep.section.sampler == "tpe":
        raise SpecError(
            f"sweep.sampler tpe learns from trials that ended, and {name} ends none before "
            "every trial has reached its first rung, so TPE would draw every trial blind: use "
            "sampler: random or qmc with it, or tpe with pruner: median or none",
            field="sweep.sampler",
        )


def _check_sampler(sweep: Sweep) -> None:
    """A grid has a finite number of points (choices and int ranges only), at least the
    number of trials."""
    if sweep.section.sampler != "grid":
        return
    points = 1
    for d in sweep.dimensions:
        axis = d.grid()
        if axis is None:
            raise SpecError(
                f"sweep.space.{d.key}: the grid sampler takes choice and int dimensions only "
                f"(a {d.kind} range has no grid): write it as a choice, or use sampler: qmc",
                field=f"sweep.space.{d.key}",
            )
        points *= len(axis)
    if sweep.section.trials > points:
        raise SpecError(
            f"sweep.trials {sweep.section.trials} is more than the grid's {points} points: "
            f"set trials: {points} or fewer",
            field="sweep.trials",
        )
