"""The Dataset form without Ray: the order of indices and the seeded samples read through
torch's DataLoader are the same for any worker count, any number of loader processes and from
any cursor; the training's own generators are not touched; setup refuses what cannot resume."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest
import torch

from tests.torch_datasets import Augmented, digest
from trainer_core.data import samples
from trainer_core.data.sample_loader import RankSamples
from trainer_core.errors import SpecError
from trainer_core.run import preflight
from trainer_core.spec.overrides import build_spec

#: 4 loader processes on 2 cores: torch warns; they are what the test is about.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def raw_spec(tmp_path, **data: Any) -> dict:
    return {
        "run": {"name": "samples", "storage": str(tmp_path), "seed": 3},
        "model": {"name": "tests.torch_datasets:recording_mlp"},
        "data": {
            "dataset": "tests.torch_datasets:augmented",
            "task": "classification",
            "batch_size": 10,
            "loader_workers": 0,
            **data,
        },
        "schedule": {"epochs": 2},
        "scaling": {"num_workers": 1},
    }


def epoch_digests(
    dataset: Any, spec: Any, world_size: int, workers: int, epoch: int, first: int = 0
) -> list[list[str]]:
    """Every global batch of ``epoch`` from ``first``: each rank's slice read by its own
    ``RankSamples`` (``workers`` loader processes), joined in rank order."""
    data = spec.data.model_copy(update={"loader_workers": workers})
    ranks = [
        RankSamples(dataset, None, data, spec.run.seed, world_size, r) for r in range(world_size)
    ]
    try:
        slices = [
            [[digest(x) for x in b["input"]] for _, _, b in r.epoch(epoch, first)] for r in ranks
        ]
    finally:
        for rank in ranks:
            rank.close()
    return [
        [d for rank in range(world_size) for d in slices[rank][n]] for n in range(len(slices[0]))
    ]


def test_every_sample_and_its_draw_is_the_same_for_any_workers_loader_processes_and_cursor(
    tmp_path,
):
    """The oracle: one process, no loader process, reading the whole epoch. 2 ranks with 2
    loader processes each and 3 ranks (the batch of 10 split 3/3/4) with 4 give the same
    global batches, also from a cursor mid-epoch; epoch 1 differs from epoch 0 in order and in
    each sample's draw."""
    spec = build_spec(raw_spec(tmp_path))
    dataset = Augmented(96)
    one = epoch_digests(dataset, spec, 1, 0, epoch=0)
    # 96 samples, 0.2 held out by hash for validation, batches of 10
    assert len(one) == len(samples.IndexOrder(96, spec.data, 3, split=True).train_ids) // 10
    assert epoch_digests(dataset, spec, 2, 2, epoch=0) == one
    assert epoch_digests(dataset, spec, 3, 4, epoch=0, first=3) == one[3:]
    other = epoch_digests(dataset, spec, 1, 0, epoch=1)
    drawn = {d for batch in one for d in batch}
    assert other != one and not drawn & {d for batch in other for d in batch}  # new draws


def test_each_samples_seed_is_the_one_runs_were_started_with():
    """The seeds are part of every run's draws (a resume must find them again): values and a
    digest of 972 keys recorded from the first release's numpy splitmix64 (3a025a6), over
    run.seed's range, training epochs, the validation key and indices up to a million."""
    assert samples.sample_seed(0, 0, 0) == 6051592478144432707
    assert samples.sample_seed(3, 1, 95) == 2008890544576475837
    assert samples.sample_seed(2**32 - 1, samples.VALIDATION, 10**9) == 1011090664282525618
    assert samples.sample_seed(12345, 2**31, 2**62) == 2288781561702047406
    keys = [
        (seed, epoch, index)
        for seed in (0, 3, 2**32 - 1)
        for epoch in (0, 1, 7, samples.VALIDATION)
        for index in range(0, 10**6, 12347)
    ]
    seeds = ",".join(str(samples.sample_seed(*key)) for key in keys)
    digest_ = hashlib.sha256(seeds.encode()).hexdigest()
    assert digest_ == "549237db835c9030d24a34751f3f425be5ffcf23f73bc61e6a31ef2dcc6a353f"


def test_reading_in_the_training_process_leaves_its_generators_as_they_were(tmp_path):
    """With no loader process the samples are drawn in the training process: the dropout and
    other draws of the training that follow are those it would make without the reading."""
    spec = build_spec(raw_spec(tmp_path))
    stream = RankSamples(Augmented(96), None, spec.data, 3, 1, 0)
    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    expected = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    next(stream.epoch(0))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_a_validation_set_of_its_own_is_read_whole_and_the_same_every_epoch(tmp_path):
    spec = build_spec(
        raw_spec(
            tmp_path, validation="tests.torch_datasets:augmented", validation_kwargs={"length": 25}
        )
    )
    held = Augmented(25)
    ranks = [RankSamples(Augmented(96), held, spec.data, 3, 2, r) for r in range(2)]
    first = [digest(x) for r in ranks for b in r.validation() for x in b["input"]]
    again = [digest(x) for r in ranks for b in r.validation() for x in b["input"]]
    assert len(first) == 25 == len(set(first)) and first == again
    # with its own validation set every training index trains
    assert ranks[0].batches_per_epoch == 96 // 10


@pytest.mark.parametrize(
    ("dataset", "field", "words"),
    [
        ("tests.torch_datasets:iterable", "data.dataset", "IterableDataset"),
        ("tests.torch_datasets:no_length", "data.dataset", "no __len__"),
        ("tests.torch_datasets:own_generator", "data.dataset", "different when drawn twice"),
        ("tests.torch_datasets:ragged", "data.dataset", "cannot be batched"),
    ],
)
def test_setup_refuses_a_dataset_that_cannot_resume_exactly(tmp_path, dataset, field, words):
    spec = build_spec(raw_spec(tmp_path, dataset=dataset))
    with pytest.raises(SpecError) as raised:
        preflight.validate_workload(spec)
    assert raised.value.field == field and words in str(raised.value)
    assert dataset in str(raised.value)


def test_a_dataset_whose_length_changed_since_the_run_began_is_refused_naming_both(tmp_path):
    spec = build_spec(raw_spec(tmp_path, kwargs={"length": 80}))
    began = samples.lengths_record(Augmented(96), None)
    with pytest.raises(SpecError) as raised:
        preflight.pin_samples(spec, began)
    assert raised.value.field == "data.dataset"
    assert "80" in str(raised.value) and "96" in str(raised.value)
    assert preflight.pin_samples(build_spec(raw_spec(tmp_path)), began).record == began


def test_the_parquet_forms_keys_are_refused_with_a_dataset_function(tmp_path):
    with pytest.raises(SpecError, match=r"data\.columns reads Parquet columns"):
        build_spec(raw_spec(tmp_path, columns=["x"]))
    with pytest.raises(SpecError, match="belongs to the Dataset form"):
        build_spec(
            raw_spec(tmp_path, dataset="digits", validation="tests.torch_datasets:augmented")
        )


def test_a_huggingface_dataset_with_an_on_the_fly_transform_is_read_the_same_way(tmp_path):
    """datasets.Dataset.with_transform (noise from torch's generator): setup accepts it (the
    model called on its "features"), and 2 ranks with a loader process each read the global
    batches one process reads, each sample with its draw."""
    raw = raw_spec(tmp_path, dataset="tests.torch_datasets:hf_samples", kwargs={"length": 60})
    raw["model"]["inputs"] = "features"
    spec = build_spec(raw)
    assert preflight.validate_workload(spec) == 2 * (
        len(samples.IndexOrder(60, spec.data, 3, True).train_ids) // 10
    )
    dataset = samples.build_dataset(spec.data.dataset, spec.data.kwargs, "data.dataset")

    def digests(world_size: int, workers: int) -> list[list[str]]:
        data = spec.data.model_copy(update={"loader_workers": workers})
        ranks = [RankSamples(dataset, None, data, 3, world_size, r) for r in range(world_size)]
        try:
            read = [[[digest(x) for x in b["features"]] for _, _, b in r.epoch(0)] for r in ranks]
        finally:
            for rank in ranks:
                rank.close()
        return [[d for r in read for d in r[n]] for n in range(len(read[0]))]

    one = digests(1, 0)
    assert len(one) == 4 and digests(2, 1) == one
