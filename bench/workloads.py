"""Workloads of the columns form against plain PyTorch, side by side in one process.

- **Language model** (``lm_*``): the GPT of ``examples/lm_gpt.py`` on the byte tokens of
  ``examples/data/pydoc_bytes.parquet``, random crops of 96 tokens.
  - ``lm_relaytrain_<n>w``: one engine attempt with n workers: the built-in loop's columns
    form, with its reporting, validation and checkpoints at the spec's cadence.
  - ``lm_plain_<n>w``: a plain PyTorch DDP loop (``torch.multiprocessing`` + gloo). It runs the
    same model on the same batches, made as relaytrain's loop makes them (its reader and
    transform, in the same read-ahead thread), with each rank's mean token loss, a loss
    all-reduce every ``report.every`` steps, a ``torch.save`` checkpoint every
    ``checkpoint.every`` and, every epoch, the loss and token accuracy of the 5% of rows
    relaytrain holds out (made by its validation transform). The ratio is then the loop's own
    cost: the step's sum-and-count all-reduce and rescale, metrics, checkpoints.
  - Figure: tokens/s over rank 0's first to last step (the probe of ``bench.probe``).
  - Target: relaytrain / plain >= 0.97 at 1 and 2 workers.
- **Vision** (``vision_*``): transformers' ResNet of ``examples/vision_resnet.py`` on the PNG
  digits, decoded and augmented (crop, flip) by 2 transform processes per worker (the
  example's ``data.transform_pool``).
  - ``vision_relaytrain_<n>w``: an engine attempt; it validates its held-out 20% every epoch.
  - ``vision_dataloader_<n>w``: plain PyTorch DDP fed by a ``torch.utils.data.DataLoader``
    with the same decode and augmentation in 2 persistent worker processes per rank, forked
    (as under torchrun). It trains on the rows relaytrain trains on and validates the rows it
    holds out every epoch, through a second such loader with the example's validation
    transform, as a plain loop would (loss and accuracy all-reduced). A ``DistributedSampler``
    shards the rows; the images are the same, the order and the draws are not.
  - Figures: images/s, and the share of rank 0's step time spent waiting for data.
  - Target: relaytrain / DataLoader >= 1.0.

Each LM run trains ``--epochs`` epochs, each vision run 4 times as many (the digits are 1,797
images: 22 steps an epoch at 1 worker); the probe's span starts after the first step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench import common, harness
from bench.common import REPO, Result, Sample, Target, Variant
from bench.plain_ddp import join_group, spawn
from bench.probe import StepProbe, done_event, read_probe, span
from trainer_core.checkpoint import optimizers, training_state
from trainer_core.data import footers, rank_stream
from trainer_core.data.transform import Batches
from trainer_core.spec.imports import import_object
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.batch_workload import BatchWorkload, logits_of

NAME = "workloads"
LM_TARGET = Target(
    "lm tokens/s, relaytrain / plain",
    "tokens/s of relaytrain's columns-form loop / a plain PyTorch DDP loop, same model and "
    "batches (the lower of 1 and 2 workers)",
    ">=",
    0.97,
)
VISION_TARGET = Target(
    "vision images/s, relaytrain / DataLoader",
    "images/s of relaytrain (decode and augment in its transform pool) / plain PyTorch fed "
    "by a DataLoader with the same decode, augmentation and worker count (the lower of 1 and "
    "2 workers)",
    ">=",
    1.0,
)
COLUMNS = ["items_per_s", "steps_per_s", "data_wait_share", "wall_s"]


def lm_spec(root: Path, name: str, workers: int, epochs: int, quick: bool) -> RunSpec:
    size = {"layers": 1, "width": 32} if quick else {"layers": 4, "width": 128}
    return build_spec(
        {
            "run": {"name": name, "storage": str(root), "seed": 0},
            "model": {
                "name": "examples.lm_gpt:build",
                "kwargs": {"block_size": 128, "heads": 4, "dropout": 0.1, **size},
            },
            "data": {
                "dataset": str(REPO / "examples" / "data" / "pydoc_bytes.parquet"),
                "columns": ["tokens"],
                "transform": "examples.lm_gpt:crop",
                "eval_transform": "examples.lm_gpt:tokens",
                "task": "causal_lm",
                "batch_size": 16 * workers,
                "validation_fraction": 0.05,
            },
            "optimizer": {"name": "adamw", "lr": 0.002, "weight_decay": 0.0},
            "schedule": {"epochs": epochs},
            "scaling": {"num_workers": workers},
            "checkpoint": {"every": 50, "keep_last": 2, "best_metric": "val_perplexity"},
            "report": {"every": 10},
        }
    )


def vision_spec(root: Path, name: str, workers: int, epochs: int, quick: bool) -> RunSpec:
    raw = _example("vision_resnet.yaml")
    raw["run"] = {"name": name, "storage": str(root), "seed": 0}
    raw["data"]["dataset"] = str(REPO / raw["data"]["dataset"])
    raw["data"]["batch_size"] = 64 * workers
    raw["schedule"] = {"epochs": 4 * epochs}  # 22 steps an epoch at 1 worker
    raw["scaling"] = {"num_workers": workers}
    return build_spec(raw)


def _example(name: str) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def items_per_step(spec: RunSpec) -> int:
    """Tokens (the LM: the crop's 96 a row) or images of a global batch."""
    assert spec.data is not None
    per_row = 96 if spec.data.task == "causal_lm" else 1
    return spec.data.batch_size * per_row


def sample_of(spec: RunSpec, wall: float) -> Sample:
    assert spec.run.name is not None
    events = read_probe(spec.run.name)
    measured = span(events)
    timings = done_event(spec.run.name).get("timings") or {}
    step_s, wait_s = timings.get("step_s"), timings.get("data_wait_s")
    sample: Sample = {
        "items_per_s": measured["steps_per_s"] * items_per_step(spec),
        "steps_per_s": measured["steps_per_s"],
        "wall_s": wall,
    }
    if step_s and wait_s is not None:
        sample["data_wait_share"] = wait_s / (step_s + wait_s)
    harness.remove_run(spec)
    return sample


def measure_relaytrain(spec: RunSpec) -> Sample:
    started = time.time()
    harness.run_engine(spec)
    return sample_of(spec, time.time() - started)


def measure_plain(spec: RunSpec, root: Path, loader: bool) -> Sample:
    assert spec.run.name is not None
    directory = root / spec.run.name
    directory.mkdir(parents=True, exist_ok=True)
    started = spawn(_plain_worker, spec, str(directory), loader)
    return sample_of(spec, time.time() - started)


# -- the plain PyTorch side ------------------------------------------------------------------


def _plain_worker(rank: int, spec_json: dict[str, Any], port: int, out: str, loader: bool) -> None:
    spec = join_group(rank, spec_json, port)
    try:
        _plain_train(spec, rank, spec.scaling.num_workers, Path(out), loader)
    finally:
        dist.destroy_process_group()


def _plain_train(spec: RunSpec, rank: int, world: int, out: Path, loader: bool) -> None:
    assert spec.model and spec.data and spec.schedule and spec.run.name
    data = spec.data
    training_state.seed_everything(spec.run.seed)
    model = workloads.build_model(spec.model, 0, 0, columns_form=True)
    ddp: torch.nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = optimizers.make_optimizer(model.parameters(), spec.optimizer)
    workload = BatchWorkload(spec)
    stream = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, world, rank)
    batches = Batches(data, spec.run.seed)
    eval_batches = Batches(data, spec.run.seed, training=False, pool=batches.pool)
    probe = StepProbe(spec.run.name, rank)
    step, step_s, wait_s = 0, 0.0, 0.0
    images, held_out = _dataloaders(spec, rank, world) if loader else (None, None)
    for epoch in range(spec.schedule.epochs):
        ahead: Any = None
        if images is not None:
            images.sampler.set_epoch(epoch)
            epoch_batches: Any = images
        else:  # relaytrain's batches, read and transformed ahead as its loop does
            ahead = stream.epoch(epoch, make_batch=batches.start)
            epoch_batches = (batch for _, _, batch in ahead)
        ddp.train()
        waited = time.perf_counter()
        for batch in epoch_batches:
            started = time.perf_counter()
            wait_s += started - waited
            step += 1
            optimizer.zero_grad(set_to_none=True)
            total, count = workload.loss(workload.forward(ddp, batch), batch)
            (total / count).backward()
            optimizer.step()
            float(total.detach())  # the loss as a number, as every loop reads it
            step_s += time.perf_counter() - started
            probe.stepped(step)
            if step % spec.report.every == 0:
                dist.all_reduce(torch.tensor([float(total.detach())]))
            if step % spec.checkpoint.every == 0 and rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                    out / "checkpoint.pt",
                )
            waited = time.perf_counter()
        if ahead is not None:
            ahead.close()
        if held_out is not None:  # the DataLoader's
            _validate(ddp, workload, held_out)
        else:  # relaytrain's validation batches, made ahead as its loop makes them
            parts = stream.validation_with_ids()
            _validate(ddp, workload, eval_batches.each(0, parts, ahead=data.prefetch))
    batches.close()
    eval_batches.close()
    probe.done(timings={"step_s": step_s, "data_wait_s": wait_s})


class EncodedImages(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The Parquet file's rows, each through the spec's transform with a generator of its own."""

    def __init__(self, path: str, transform: Any):
        self.table = pq.read_table(path).to_pylist()
        self.transform = transform
        self.rng = np.random.default_rng()  # each loader process its own (forked, then reseeded)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.transform(self.table[index], self.rng))


def _reseed(worker: int) -> None:
    dataset = torch.utils.data.get_worker_info().dataset.dataset  # type: ignore[union-attr]
    dataset.rng = np.random.default_rng(torch.initial_seed() % 2**32)


def _dataloaders(spec: RunSpec, rank: int, world: int) -> tuple[Any, Any]:
    """This rank's training and validation loaders over the rows relaytrain's run trains and
    validates on (its held-out rows, ``data.validation_fraction``)."""
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    data = spec.data
    assert data is not None and data.transform is not None
    whole = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    held = np.concatenate([ids for ids, _ in whole.validation_with_ids()])
    kept = np.setdiff1d(np.arange(whole.train_rows + len(held)), held)

    def loader(ids: np.ndarray, path: str, field: str, batch: int, training: bool) -> Any:
        dataset = Subset(EncodedImages(data.dataset, import_object(path, field)), ids.tolist())
        sampler = DistributedSampler(
            dataset, world, rank, shuffle=training, seed=spec.run.seed, drop_last=training
        )
        return DataLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            num_workers=data.transform_workers,
            drop_last=training,
            persistent_workers=True,
            worker_init_fn=_reseed,
            # torchrun's processes fork their loader workers; mp.spawn's would spawn them
            multiprocessing_context="fork",
        )

    eval_path = data.eval_transform or data.transform
    return (
        loader(kept, data.transform, "data.transform", data.batch_size // world, True),
        loader(held, eval_path, "data.eval_transform", data.batch_size // world, False),
    )


def _validate(model: torch.nn.Module, workload: BatchWorkload, held_out: Any) -> None:
    """The held-out rows' summed loss and correct labels (per sample, or per labelled token),
    reduced over the ranks, as a plain loop would validate each epoch."""
    model.eval()
    sums = torch.zeros(3)
    with torch.no_grad():
        for batch in held_out:
            out = workload.forward(model, batch)
            total, count = workload.loss(out, batch)
            predicted, labels = logits_of(out).argmax(-1), batch["labels"]
            if predicted.dim() > 1:  # position t predicts token t + 1
                predicted, labels = predicted[:, :-1], labels[:, 1:]
            correct = (predicted == labels).sum()
            sums += torch.stack([total.float(), torch.as_tensor(count).float(), correct.float()])
    dist.all_reduce(sums)
    model.train()


# -- the benchmark ---------------------------------------------------------------------------


#: Each kind: its spec, its baseline's name and description, whether the baseline reads through
#: a DataLoader, and what relaytrain's variant runs.
KINDS: dict[str, tuple[Any, str, str, bool, str]] = {
    "lm": (
        lm_spec,
        "plain",
        "plain DDP, {n} process(es), batches as relaytrain makes them",
        False,
        "engine attempt, {n} worker(s)",
    ),
    "vision": (
        vision_spec,
        "dataloader",
        "plain DDP fed by 2 DataLoaders (train, validate), {n} process(es), 2 workers each",
        True,
        "engine attempt, {n} worker(s), 2 transform processes each",
    ),
}


def variants(root: Path, epochs: int, quick: bool, kinds: list[str]) -> list[Variant]:
    found = []
    for workers in (1, 2):
        for kind in kinds:
            make, baseline, described, loader, ours = KINDS[kind]

            def spec(prefix: str, rep: int, w: int = workers, make: Any = make) -> RunSpec:
                return make(root, f"{prefix}{w}w-{rep}", w, epochs, quick)

            found += [
                Variant(
                    f"{kind}_relaytrain_{workers}w",
                    ours.format(n=workers),
                    lambda rep, spec=spec, kind=kind: measure_relaytrain(spec(f"{kind}-rt", rep)),
                ),
                Variant(
                    f"{kind}_{baseline}_{workers}w",
                    described.format(n=workers),
                    lambda rep, spec=spec, kind=kind, loader=loader: measure_plain(
                        spec(f"{kind}-base", rep), root, loader
                    ),
                ),
            ]
    return found


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--epochs", type=int, default=None, help="epochs per run (default 2)")
    cli.add_argument("--kinds", default="lm,vision", help="lm, vision or both")
    args = cli.parse_args(argv)
    epochs = args.epochs or (1 if args.quick else 2)
    kinds = args.kinds.split(",")
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.session() as (root, session):
        result.settings.update(session, epochs=epochs, kinds=kinds)
        result.variants = common.measure(variants(root, epochs, args.quick, kinds), args)
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    records = result.variants
    for prefix, baseline, target in [
        ("lm", "plain", LM_TARGET),
        ("vision", "dataloader", VISION_TARGET),
    ]:
        ratios = {
            w: common.ratio(
                records, f"{prefix}_relaytrain_{w}w", f"{prefix}_{baseline}_{w}w", "items_per_s"
            )
            for w in (1, 2)
        }
        found = [r for r in ratios.values() if r is not None]
        note = ", ".join(f"{w}w {r:.3f}" for w, r in ratios.items() if r is not None)
        if found:
            result.targets.append(target.check(min(found), note))
            result.figures[f"{prefix} relaytrain/{baseline} by workers"] = ratios


if __name__ == "__main__":
    raise SystemExit(main())
