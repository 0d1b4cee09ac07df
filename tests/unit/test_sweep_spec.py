"""The sweep spec (trainer_core/sweep): what it refuses at setup, naming the key, and each
trial's values drawn by its number, the same in any order and after any restart."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from trainer_core.errors import SpecError
from trainer_core.sweep.sampling import Finished, trial_values
from trainer_core.sweep.spec import Sweep, build_sweep, load_sweep

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.yaml"
SPACE = {
    "optimizer.lr": {"log_uniform": [1.0e-4, 1.0e-1]},
    "model.kwargs.channels": {"choice": [[8, 16], [16, 32]]},
    "data.batch_size": {"int": [32, 128, 32]},
}


def raw(**sweep: Any) -> dict[str, Any]:
    base = yaml.safe_load(EXAMPLE.read_text())
    base["run"]["name"] = "digits-lr"
    section = {"trials": 6, "concurrent": 2, "metric": "val_loss", "seed": 7, "space": SPACE}
    for key, value in sweep.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    return {**base, "sweep": copy.deepcopy(section)}


def sweep(**settings: Any) -> Sweep:
    return build_sweep(raw(**settings))


def test_a_trial_is_the_base_spec_with_its_values_and_its_own_name():
    s = sweep()
    spec = s.trial_spec(3, {"optimizer.lr": 0.01, "model.kwargs.channels": [8, 16]})
    assert spec.run.name == "digits-lr-t003"
    assert spec.optimizer.lr == 0.01 and spec.model.kwargs["channels"] == [8, 16]
    assert spec.run.storage == "./runs" and spec.data.batch_size == 64  # the rest as written
    assert s.direction == "minimize"
    assert isinstance(s.pruner(), optuna.pruners.NopPruner)
    assert isinstance(
        sweep(pruner={"successive_halving": {"reduction_factor": 2}}).pruner(),
        optuna.pruners.SuccessiveHalvingPruner,
    )


def test_a_sweep_file_loads_and_a_name_given_replaces_run_name(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw()))
    assert load_sweep(path).name == "digits-lr"
    assert load_sweep(path, name="other").trial_name(12) == "other-t012"
    with pytest.raises(SpecError, match=r"sweep file .* does not exist") as refused:
        load_sweep(tmp_path / "missing.yaml")
    assert refused.value.field == "--config"


@pytest.mark.parametrize(
    ("settings", "field", "says"),
    [
        (
            {"space": {"optimizer.lrr": {"uniform": [0.1, 0.2]}}},
            "sweep.space.optimizer.lrr",
            "did you mean 'lr'",
        ),
        ({"space": {"optimizer.lr": {"uniform": [-0.1, 0.2]}}}, "sweep.space.optimizer.lr", "-0.1"),
        (
            {"space": {"optimizer.lr": {"log_uniform": [0, 0.2]}}},
            "sweep.space.optimizer.lr",
            "low > 0",
        ),
        (
            {"space": {"optimizer.lr": {"uniform": [0.2, 0.2]}}},
            "sweep.space.optimizer.lr",
            "low < high",
        ),
        ({"space": {"optimizer.lr": {"gauss": [0, 1]}}}, "sweep.space.optimizer.lr", "log_uniform"),
        (
            {"space": {"data.batch_size": {"int": [30, 128, 32]}}},
            "sweep.space.data.batch_size",
            "multiple of the step",
        ),
        (
            {"space": {"data.batch_size": {"int": [32.5, 128]}}},
            "sweep.space.data.batch_size",
            "integers",
        ),
        ({"space": {"data.batch_size": {"choice": [64, -8]}}}, "sweep.space.data.batch_size", "-8"),
        (
            {"space": {"model.kwargs.channels": {"choice": []}}},
            "sweep.space.model.kwargs.channels",
            "non-empty",
        ),
        (
            {"space": {"model.kwargs.channels": {"choice": [[8], [8]]}}},
            "sweep.space.model.kwargs.channels",
            "twice",
        ),
        (
            {"space": {"run.storage": {"choice": ["a", "b"]}}},
            "sweep.space.run.storage",
            "may not set",
        ),
        ({"space": {}}, "sweep.space", "dotted keys"),
        (
            {"space": {"data.validation_fraction": {"choice": [0.0, 0.2]}}},
            "sweep.space.data.validation_fraction",
            "best_metric",
        ),
        ({"metric": "val_f1", "direction": "maximize"}, "sweep.metric", "val_f1"),
        ({"metric": "val_f1"}, "sweep.direction", "minimize"),
        ({"sampler": "cmaes"}, "sweep.sampler", "cmaes"),
        ({"sampler": "grid"}, "sweep.space.optimizer.lr", "grid"),
        (
            {"sampler": "grid", "space": {"data.batch_size": {"int": [32, 64, 32]}}},
            "sweep.trials",
            "2 points",
        ),
        ({"pruner": "asha"}, "sweep.pruner", "successive_halving"),
        ({"pruner": {"median": {"n_startup": 2}}}, "sweep.pruner", "n_startup"),
        (
            {"pruner": {"successive_halving": {"reduction_factor": 1}}},
            "sweep.pruner",
            "reduction_factor",
        ),
        ({"trials": 0}, "sweep.trials", "greater than or equal to 1"),
        ({"trials": None}, "sweep.trials", "required"),
        ({"concurrent": 0}, "sweep.concurrent", "greater than or equal to 1"),
        ({"extra": 1}, "sweep.extra", "unknown key"),
    ],
)
def test_a_bad_sweep_is_refused_naming_its_key(settings, field, says):
    with pytest.raises(SpecError) as refused:
        sweep(**settings)
    assert refused.value.field == field, refused.value
    assert says in str(refused.value)


def test_a_sweep_needs_a_name_and_a_section():
    nameless = raw()
    nameless["run"]["name"] = None
    with pytest.raises(SpecError, match="needs a name") as refused:
        build_sweep(nameless)
    assert refused.value.field == "run.name"
    with pytest.raises(SpecError, match="sweep: section"):
        build_sweep({k: v for k, v in raw().items() if k != "sweep"})


@pytest.mark.parametrize("sampler", ["random", "qmc", "grid", "tpe"])
def test_a_trials_values_do_not_depend_on_what_was_drawn_before(sampler):
    space = {k: v for k, v in SPACE.items() if sampler != "grid" or k != "optimizer.lr"}
    s = sweep(sampler=sampler, space=space)
    in_turn = [trial_values(s, n) for n in range(6)]
    backwards = [trial_values(s, n) for n in reversed(range(6))][::-1]
    assert in_turn == backwards
    assert len({json.dumps(v, sort_keys=True) for v in in_turn}) == 6
    for n, values in enumerate(in_turn):
        s.trial_spec(n, values)  # every trial's spec builds
    other_seed = [trial_values(sweep(sampler=sampler, space=space, seed=8), n) for n in range(6)]
    assert other_seed != in_turn


@pytest.mark.parametrize("sampler", ["random", "qmc", "tpe"])
def test_a_trials_values_do_not_depend_on_the_order_the_space_was_written_in(sampler):
    """A YAML dump sorts the keys, a merge may reorder them: the same space, the same values
    (the sampler draws the keys in turn, so it is asked in one order, the keys')."""
    reordered = dict(reversed(list(SPACE.items())))
    assert list(reordered) != list(SPACE)
    for n in range(4):
        written = trial_values(sweep(sampler=sampler), n)
        assert trial_values(sweep(sampler=sampler, space=reordered), n) == written


def test_the_values_are_optunas_own_sequence_for_the_seed():
    """Random and QMC give what Optuna's own ask loop gives for the seed (its study, asked in
    turn), choices decoded from the JSON Optuna stores them as."""
    for name, sampler in [
        ("random", optuna.samplers.RandomSampler(seed=7)),
        ("qmc", optuna.samplers.QMCSampler(scramble=True, seed=7)),
    ]:
        s = sweep(sampler=name)
        study = optuna.create_study(sampler=sampler)
        distributions = {d.key: d.distribution for d in s.dimensions}
        for n in range(5):
            asked = study.ask(distributions).params
            asked["model.kwargs.channels"] = json.loads(asked["model.kwargs.channels"])
            assert trial_values(s, n) == asked, (name, n)


def test_the_grid_takes_each_point_once():
    s = sweep(
        sampler="grid", trials=8, space={k: v for k, v in SPACE.items() if k != "optimizer.lr"}
    )
    points = {json.dumps(trial_values(s, n), sort_keys=True) for n in range(8)}
    assert len(points) == 8  # 2 channel choices x 4 batch sizes, none twice


def test_tpe_learns_only_from_the_batches_before_its_own():
    """With 2 at a time, trial 13 (batch 12-13) sees trials 0-11 ended, whatever else has
    ended; what it draws moves with what those scored."""
    s = sweep(sampler="tpe", trials=20)
    ended = []
    for n in range(14):
        values = trial_values(s, n, ended)
        stored = {k: json.dumps(v) if isinstance(v, list) else v for k, v in values.items()}
        ended.append(Finished(n, stored, "complete", value=abs(values["optimizer.lr"] - 0.01)))
    before = [f for f in ended if f.number < 12]
    assert trial_values(s, 13, before) == trial_values(s, 13, ended)
    upside_down = [Finished(f.number, f.values, f.state, value=-(f.value or 0)) for f in before]
    assert trial_values(s, 13, upside_down) != trial_values(s, 13, before)


@pytest.mark.parametrize(
    ("settings", "field", "says"),
    [
        (
            {"sampler": "tpe", "pruner": {"successive_halving": {}}},
            "sweep.sampler",
            "TPE would draw every trial blind",
        ),
        (
            {"pruner": {"hyperband": {"max_resource": "auto"}}},
            "sweep.pruner",
            "max_resource 'auto'",
        ),
        (
            {"pruner": "median", "space": {"schedule.epochs": {"int": [2, 4]}}},
            "sweep.space.schedule.epochs",
            "every trial trains the same epochs",
        ),
    ],
)
def test_a_pruner_the_sweep_cannot_ask_at_fixed_epochs_is_refused(settings, field, says):
    with pytest.raises(SpecError, match=re.escape(says)) as refused:
        sweep(**settings)
    assert refused.value.field == field


def test_a_pruner_on_a_loop_of_ones_own_is_refused():
    spec = raw(pruner="median")
    spec["train_loop"] = "examples.own_loop:train"
    spec["train_loop_config"] = {}
    with pytest.raises(SpecError, match="only the built-in loop") as refused:
        build_sweep(spec)
    assert refused.value.field == "sweep.pruner"
