"""A scenario drawn from one integer seed: the spec, the data as a writer makes it, and the
history of what an operator does, each command with at most one fault or damage.

Everything here is a plain value (frozen dataclasses of ints, strings and tuples), so a scenario
prints, serializes to JSON, compares, and is the same on any machine for the same seed
(``random.Random(seed)``, nothing else). ``draw(seed)`` is the only entry point; the shrinker
builds smaller scenarios with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

#: What an operator does, one command each: run the spec; run the same command again; continue
#: a run with more epochs (and perhaps another worker count); read the run (``show``,
#: ``show --time``); export a checkpoint's model (``--best`` or ``--latest``).
ACTIONS = ("run", "rerun", "continue", "show", "export")

#: What goes wrong, each tied to the command it hits:
#: - during a command: ``raise`` (the training code raises as a step begins: a Prefect retry),
#:   ``kill_rank`` (a worker process SIGKILLed as a step begins: a restart in place),
#:   ``kill_flow`` (the command's whole process group SIGKILLed once a checkpoint is committed;
#:   the operator runs the command again), ``second_flow`` (the same command started again
#:   while the first trains: refused, the first goes on), ``outage`` (object storage goes away
#:   for some seconds once a checkpoint is committed, and comes back: the run goes on),
#:   ``store_full`` (object storage answers every write as a full store from then on: the
#:   command stops naming it, on no retry; the operator frees space and runs it again),
#:   ``lose_node`` (the node the workers run on lost once a checkpoint is committed, back only
#:   some seconds after Ray counts it dead: the run waits for it and goes on), ``crowd``
#:   (an elastic command starts while other work holds every CPU of the cluster but one, and
#:   gets them once it has committed checkpoints: the run starts on fewer workers than it asks
#:   for and grows back, each resize from its newest committed checkpoint);
#: - before a command: ``flip_checkpoint`` (a byte of the newest committed checkpoint's model
#:   flipped while no flow runs: the resume must not read it), ``flip_best`` (the same to the
#:   best checkpoint of a finished run, which then continues: it must not stay the best),
#:   ``flip_data`` (a byte in a data page of one dataset file: the run must stop naming it, on
#:   no retry, and succeed once the file is restored), ``add_file`` (a file lands in the
#:   dataset's directory: a valid one, one half-written, one of another schema; the run's
#:   snapshot does not read it and nothing stops).
#: The faults that fire while the command trains (the others damage storage before it).
DURING = (
    "raise",
    "kill_rank",
    "kill_flow",
    "second_flow",
    "outage",
    "store_full",
    "lose_node",
    "crowd",
)
#: Every fault kind above: those during a command, then those before it.
FAULTS = (*DURING, "flip_checkpoint", "flip_best", "flip_data", "add_file")
#: The faults that come once the command has committed ``at`` checkpoints (the others during a
#: command are placed at a step).
AFTER_COMMITS = ("kill_flow", "second_flow", "outage", "store_full", "lose_node", "crowd")
#: The faults of object storage, and what each plays: seconds away; which store's answer.
STORAGE_FAULTS = {"outage": ("2", "5", "10"), "store_full": ("minio", "ceph")}
#: lose_node: the seconds the node stays away once Ray counts it dead (the retry comes before
#: it is back: ``drive.NODE_RETRY_DELAY_S``).
NODE_AWAY_S = ("15", "25")
ADDED_FILES = ("valid", "half_written", "other_schema")
#: How the spec trains: the tabular form (``data.features``, ``data.label``) on the built-in
#: MLP; the columns form (``data.columns``) with a user's transform and model builder; or a
#: user's loop of its own on relaytrain's API (``train_loop_api: relaytrain``). The user's code
#: is ``tests/adversary/user/adversary_user.py``.
FORMS = ("tabular", "columns", "own_loop")
#: The built-in loop's precision (a loop of one's own sets its own): fp32, or autocast to bf16.
PRECISIONS = ("fp32", "bf16")
#: The shapes a campaign counts (and the suite's seeds touch): the forms and precision past the
#: tabular form in fp32, and elastic capacity (``scaling.num_workers: [1, N]``).
SHAPES = ("columns", "own_loop", "bf16", "elastic")


@dataclass(frozen=True)
class Fault:
    kind: str
    #: raise, kill_rank: where among the command's steps it fires, in thousandths (the step
    #: itself is placed once the steps of an epoch are known: ``drive.fault_step``);
    #: kill_flow, second_flow, outage, store_full, lose_node: the checkpoints the command
    #: commits before it happens; crowd: before the CPUs held are freed.
    at: int = 0
    rank: int = 0
    #: add_file: which file lands (``ADDED_FILES``); flip_data: which dataset file; outage:
    #: its seconds; store_full: the store whose answer it plays (``STORAGE_FAULTS``);
    #: lose_node: its seconds away (``NODE_AWAY_S``).
    what: str = ""


@dataclass(frozen=True)
class Action:
    kind: str
    #: continue: the epochs added, and the worker count from then on (0: unchanged).
    epochs: int = 0
    workers: int = 0
    #: show: with ``--time``; export: ``best`` or ``latest``.
    option: str = ""
    fault: Fault | None = None


@dataclass(frozen=True)
class Data:
    """The table: ``files`` Parquet files of ``rows`` rows each, ``features`` float columns and
    a float label, row groups of ``row_group`` rows, page checksums on (as Spark writes)."""

    files: int
    rows: int
    features: int
    row_group: int
    seed: int


@dataclass(frozen=True)
class Shape:
    """The spec's knobs (the rest of the spec is fixed: ``spec_of`` in ``drive``)."""

    workers: int
    batch_size: int
    accumulation: int
    epochs: int
    every: int
    validation: bool
    keep_last: int | None
    keep_best: int
    hidden: tuple[int, ...]
    optimizer: str
    cosine: bool
    storage: str  # "local" or "s3"
    seed: int
    #: With ``validation``: the validation rows are a file of their own (``data.validation``),
    #: which the oracles score each checkpoint's weights on, rather than a hashed share.
    validation_file: bool = False
    form: str = "tabular"  # FORMS
    precision: str = "fp32"  # PRECISIONS
    #: Each command on more than one worker asks for ``[1, N]`` (Ray Train's elastic scaling:
    #: as many as the cluster holds) rather than N.
    elastic: bool = False


@dataclass(frozen=True)
class Scenario:
    seed: int
    shape: Shape
    data: Data
    history: tuple[Action, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Scenario:
        raw = json.loads(text)
        history = tuple(
            Action(**{**a, "fault": Fault(**a["fault"]) if a["fault"] else None})
            for a in raw["history"]
        )
        shape = Shape(**{**raw["shape"], "hidden": tuple(raw["shape"]["hidden"])})
        return Scenario(raw["seed"], shape, Data(**raw["data"]), history)

    def kinds(self) -> dict[str, list[str]]:
        """The action and fault kinds this scenario exercises, and the spec's shapes past the
        tabular form in fp32 (``SHAPES``): the campaign's coverage."""
        shape = self.shape
        return {
            "actions": sorted({a.kind for a in self.history}),
            "faults": sorted({a.fault.kind for a in self.history if a.fault}),
            "shapes": sorted(
                {shape.form, shape.precision, "elastic" if shape.elastic else ""} & set(SHAPES)
            ),
        }

    def describe(self) -> str:
        steps = []
        for a in self.history:
            words = [a.kind]
            if a.kind == "continue":
                words.append(
                    f"+{a.epochs} epochs" + (f" on {a.workers} workers" if a.workers else "")
                )
            if a.option:
                words.append(a.option)
            if a.fault:
                f = a.fault
                detail = {
                    "raise": f"at {f.at / 10:.1f}% of its steps",
                    "kill_rank": f"rank {f.rank} at {f.at / 10:.1f}% of its steps",
                    "kill_flow": f"after {f.at} commits",
                    "second_flow": f"after {f.at} commits",
                    "outage": f"of {f.what} s after {f.at} commits",
                    "store_full": f"({f.what}) after {f.at} commits",
                    "lose_node": f"after {f.at} commits, back {f.what} s after it is dead",
                    "crowd": f"freed after {f.at} commits",
                    "add_file": f.what,
                    "flip_data": f"file {f.what}",
                }.get(f.kind, "")
                words.append(f"[{f.kind}{' ' + detail if detail else ''}]")
            steps.append(" ".join(words))
        s = self.shape
        how = "" if s.form == "tabular" else f"{s.form.replace('_', ' ')}, "
        how += "" if s.precision == "fp32" else f"{s.precision}, "
        how += "elastic, " if s.elastic else ""
        return (
            f"seed {self.seed}: {how}{s.workers} worker(s), "
            f"batch {s.batch_size}x{s.accumulation}, "
            f"{s.epochs} epochs, checkpoint every {s.every}, "
            f"{_validation(s)}, keep_last {s.keep_last}, "
            f"keep_best {s.keep_best}, {s.storage} storage; {self.data.files} file(s) of "
            f"{self.data.rows} rows, row groups of {self.data.row_group}; " + " -> ".join(steps)
        )


def _validation(shape: Shape) -> str:
    if not shape.validation:
        return "no validation"
    return "a validation file" if shape.validation_file else "validation"


def draw(seed: int) -> Scenario:
    """The scenario of ``seed``."""
    rng = random.Random(seed)
    data = Data(
        files=rng.choice((1, 2, 3)),
        rows=rng.choice((192, 256, 320)),
        features=rng.randint(3, 9),
        row_group=rng.choice((16, 24, 50, 64)),
        seed=rng.randrange(2**31),
    )
    accumulation = rng.choice((1, 1, 2))
    shape = Shape(
        workers=rng.choice((1, 2, 2)),
        batch_size=16 if accumulation > 1 else rng.choice((16, 32)),
        accumulation=accumulation,
        epochs=rng.choice((2, 3)),
        every=rng.choice((2, 3, 4, 5, 7)),
        validation=rng.random() < 0.6,
        keep_last=rng.choice((None, 1, 2, 3)),
        keep_best=rng.choice((0, 1)),
        hidden=rng.choice(((8,), (16, 16), (12, 8))),
        optimizer=rng.choice(("adam", "sgd")),
        cosine=rng.random() < 0.5,
        storage=rng.choice(("local", "local", "s3")),
        seed=rng.randrange(1000),
    )
    history = [Action("run", fault=_during(rng, shape))]
    epochs = shape.epochs
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(("rerun", "rerun", "continue", "continue", "continue", "show", "export"))
        if kind == "continue":
            more = rng.choice((1, 2))
            workers = rng.choice((0, 0, 1, 2))
            # A damaged newest (or best) checkpoint moves the resume before the continue's
            # first step: on another worker count, steps the reference trained on the old one
            # (the bits of a step depend on the world size: each rank draws its own dropout).
            fault = _before_continue(rng, data, workers == 0) or _during(rng, shape)
            history.append(Action("continue", epochs=more, workers=workers, fault=fault))
            epochs += more
        elif kind == "rerun":
            fault = Fault("add_file", what=rng.choice(ADDED_FILES)) if rng.random() < 0.5 else None
            history.append(Action("rerun", fault=fault))
        elif kind == "show":
            history.append(Action("show", option=rng.choice(("", "--time"))))
        else:
            history.append(Action("export", option=rng.choice(("best", "latest"))))
    # Drawn last, so that every earlier draw of a seed is what it was before these knobs.
    shape = dataclasses.replace(shape, validation_file=shape.validation and rng.random() < 0.5)
    history = _best_damaged_before_reruns(rng, history)
    if shape.storage == "s3":
        history = _storage_faults(rng, history)
    history = _lost_nodes(rng, history)
    # A loop of one's own steps once a batch: relaytrain's API gained accumulation
    # (``ends_step``) after dc43134, a checkout the adversary must still drive.
    own = ("own_loop",) if shape.accumulation == 1 else ("tabular",)
    form = rng.choice(("tabular", "tabular", "columns", *own))
    precision = "bf16" if form != "own_loop" and rng.random() < 0.3 else "fp32"
    shape = dataclasses.replace(shape, form=form, precision=precision)
    # Elastic capacity where more than one worker trains, not where the node is lost (the
    # group's resource is on that node alone: an elastic group has no size to go on with).
    scenario = Scenario(seed, shape, data, tuple(history))
    elastic = shape.workers > 1 and not on_a_node_of_their_own(scenario) and rng.random() < 0.3
    scenario = dataclasses.replace(scenario, shape=dataclasses.replace(shape, elastic=elastic))
    # Drawn last, and only for an elastic shape: every other seed's scenario is what it was.
    return _crowded(rng, scenario) if elastic else scenario


def _best_damaged_before_reruns(rng: random.Random, history: list[Action]) -> list[Action]:
    """Some reruns with no fault of their own become reruns of a run whose best checkpoint was
    damaged: the rerun must not publish it as the best again. Not where a later continue moves
    to another worker count (the best may be the newest checkpoint, and the continue would then
    retrain from an older one on the other count: not the reference's bits)."""
    drawn = []
    for i, action in enumerate(history):
        moves = any(a.kind == "continue" and a.workers for a in history[i:])
        damaged = action.kind == "rerun" and action.fault is None and rng.random() < 0.4
        if damaged and not moves:
            action = dataclasses.replace(action, fault=Fault("flip_best"))
        drawn.append(action)
    return drawn


def _storage_faults(rng: random.Random, history: list[Action]) -> list[Action]:
    """Object storage failing under some of the commands that train with no fault of their
    own (drawn after everything else: earlier draws stand)."""
    drawn = []
    for action in history:
        if action.kind in ("run", "continue") and action.fault is None and rng.random() < 0.4:
            kind = rng.choice(sorted(STORAGE_FAULTS))
            fault = Fault(kind, at=rng.randint(1, 2), what=rng.choice(STORAGE_FAULTS[kind]))
            action = dataclasses.replace(action, fault=fault)
        drawn.append(action)
    return drawn


def _lost_nodes(rng: random.Random, history: list[Action]) -> list[Action]:
    """The node under some of the commands that train with no fault of their own lost (drawn
    after everything else: earlier draws stand)."""
    drawn = []
    for action in history:
        if action.kind in ("run", "continue") and action.fault is None and rng.random() < 0.15:
            fault = Fault("lose_node", at=rng.randint(1, 2), what=rng.choice(NODE_AWAY_S))
            action = dataclasses.replace(action, fault=fault)
        drawn.append(action)
    return drawn


def _crowded(rng: random.Random, scenario: Scenario) -> Scenario:
    """Other work holding the cluster as some of an elastic scenario's commands that train on
    more than one worker, with no fault of their own, start."""
    drawn = []
    workers = scenario.shape.workers
    for action in scenario.history:
        workers = action.workers or workers
        crowded = action.kind in ("run", "continue") and action.fault is None and workers > 1
        if crowded and rng.random() < 0.5:
            action = dataclasses.replace(action, fault=Fault("crowd", at=rng.randint(1, 2)))
        drawn.append(action)
    return dataclasses.replace(scenario, history=tuple(drawn))


def on_a_node_of_their_own(scenario: Scenario) -> bool:
    """Whether the scenario's workers run on the world's worker node (the one it loses), not on
    the head."""
    return any(a.fault and a.fault.kind == "lose_node" for a in scenario.history)


def _during(rng: random.Random, shape: Shape) -> Fault | None:
    """A fault while a command trains (or none)."""
    kind = rng.choice((None, "raise", "kill_rank", "kill_flow", "second_flow"))
    if kind is None:
        return None
    if kind in ("kill_flow", "second_flow"):
        return Fault(kind, at=rng.randint(1, 2))
    rank = rng.randrange(shape.workers) if kind == "kill_rank" else 0
    return Fault(kind, at=rng.randrange(1000), rank=rank)


def _before_continue(rng: random.Random, data: Data, same_workers: bool) -> Fault | None:
    """Damage done to a finished run or its data before it continues (or none); a checkpoint
    damaged only where the continue keeps the worker count."""
    kind = rng.choice((None, None, "flip_best", "flip_checkpoint", "flip_data", "add_file"))
    if kind in ("flip_best", "flip_checkpoint") and not same_workers:
        kind = None
    if kind == "add_file":
        return Fault("add_file", what=rng.choice(ADDED_FILES))
    if kind == "flip_data":
        return Fault("flip_data", what=str(rng.randrange(data.files)))
    return Fault(kind) if kind else None


def as_dict(scenario: Scenario) -> dict[str, Any]:
    return dataclasses.asdict(scenario)
