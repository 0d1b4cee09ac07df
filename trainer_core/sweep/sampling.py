"""Each trial's values, drawn by its number: the same for a sweep's seed whatever ran when, how
many trials ran at once, or how often the sweep was stopped and run again.

Optuna's samplers keep state between asks (a random generator, a QMC sequence's position, the
grid points taken), and an adaptive one (TPE) reads every trial finished when it is asked, so a
study asked from several places, or asked again after a crash, draws other values. Here a
trial's values are drawn afresh from a study of its own, in memory, that holds only what the
number fixes:

- ``random``, ``qmc``, ``grid``: the sampler made from the sweep's seed, asked for trials 0 to
  ``n`` in turn; trial ``n`` takes the last. The values are Optuna's own sequence for that seed.
- ``tpe``: the trials of the batches before trial ``n``'s (``concurrent`` trials a batch), as
  they ended, and a sampler seeded with the sweep's seed and ``n``. A batch starts once every
  trial before it has ended, so TPE with ``concurrent`` above 1 learns less often than
  Optuna's own loop would; with ``concurrent: 1`` it learns from every trial.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from trainer_core.sweep.spec import Sweep


@dataclass(frozen=True)
class Finished:
    """A trial that ended, as TPE learns from it: its values (as Optuna stores them), the
    metric at its end (None for a failed trial) and the metric at each validation step."""

    number: int
    values: Mapping[str, Any]
    state: str  # "complete" | "pruned" | "failed"
    value: float | None = None
    intermediate: Mapping[int, float] = field(default_factory=dict)


def batch_start(sweep: Sweep, number: int) -> int:
    """The first trial of ``number``'s batch: the trials TPE may learn from end before it."""
    size = sweep.section.concurrent or 1
    return number // size * size


def trial_values(sweep: Sweep, number: int, finished: Sequence[Finished] = ()) -> dict[str, Any]:
    """Trial ``number``'s values by dotted key, as its run spec takes them (a choice's JSON
    decoded). ``finished``: the ended trials (TPE reads those before ``batch_start``)."""
    distributions = {d.key: d.distribution for d in sweep.dimensions}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = sweep.section.sampler
    if name == "tpe":
        seen = [f for f in finished if f.number < batch_start(sweep, number)]
        study = _study(sweep, optuna.samplers.TPESampler(seed=_seed(sweep, number)))
        for f in sorted(seen, key=lambda f: f.number):
            study.add_trial(as_trial(f, distributions))
        asked = study.ask(distributions)
    else:
        study = _study(sweep, _sequence_sampler(sweep))
        for _ in range(number + 1):
            asked = study.ask(distributions)
    dimensions = {d.key: d for d in sweep.dimensions}
    return {key: dimensions[key].value(value) for key, value in asked.params.items()}


def _study(sweep: Sweep, sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    return optuna.create_study(direction=sweep.direction, sampler=sampler)


def _sequence_sampler(sweep: Sweep) -> optuna.samplers.BaseSampler:
    seed = sweep.section.seed
    if sweep.section.sampler == "grid":
        axes = {d.key: d.grid() for d in sweep.dimensions}
        return optuna.samplers.GridSampler(axes, seed=seed)  # type: ignore[arg-type]
    if sweep.section.sampler == "qmc":
        with warnings.catch_warnings():  # experimental in Optuna 5, and said so on every make
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(
                scramble=True, seed=seed, warn_asynchronous_seeding=False
            )
    return optuna.samplers.RandomSampler(seed=seed)


def _seed(sweep: Sweep, number: int) -> int:
    digest = hashlib.sha256(f"{sweep.section.seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def as_trial(
    f: Finished, distributions: Mapping[str, optuna.distributions.BaseDistribution]
) -> optuna.trial.FrozenTrial:
    """The ended trial ``f`` as Optuna's, for a study in memory (samplers and pruners read it)."""
    state = {
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "failed": optuna.trial.TrialState.FAIL,
    }[f.state]
    return optuna.trial.create_trial(
        params=dict(f.values),
        distributions=dict(distributions),
        value=f.value if state == optuna.trial.TrialState.COMPLETE else None,
        intermediate_values=dict(f.intermediate),
        state=state,
    )
