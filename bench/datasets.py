"""The Dataset form (``data.dataset: package.module:function``, a map-style torch ``Dataset``)
against a plain PyTorch ``DataLoader`` + ``DistributedSampler`` on the same dataset, side by side
in one process; and what the Dataset form's per-sample seeding costs.

Workload: ``examples/image_folder.py`` (``examples/image_folder.yaml``): the PNG digits' training
split (1,437 images) decoded with Pillow and augmented (random crop, brightness and contrast
jitter drawn from torch's global generator) by ``data.loader_workers`` loader processes per
worker (the example's 2), the small CNN, Adam with a cosine schedule, a batch of 64 per worker.

- ``relaytrain_<n>w``: one engine attempt with n workers: the built-in loop on the Dataset form
  (``trainer_core.data.sample_loader.RankSamples``: torch's ``DataLoader`` with relaytrain's
  batch sampler from the cursor, each sample seeded from (run.seed, epoch, index)), validating
  the validation split every epoch, checkpointing every 20 steps and after each validation,
  reporting every 10 steps.
- ``dataloader_<n>w``: plain PyTorch DDP (``torch.multiprocessing`` + gloo, as
  ``bench.plain_ddp``): the dataset the spec names, unwrapped, through
  ``DataLoader(dataset, batch_size=64, sampler=DistributedSampler(dataset, shuffle=True),
  num_workers=data.loader_workers, persistent_workers=True)``, forked (as under torchrun), the
  same model, optimizer, schedule, loss and epochs; the validation split through a second such
  loader every epoch (loss and accuracy all-reduced), a loss all-reduce every ``report.every``
  steps, a ``torch.save`` checkpoint every ``checkpoint.every`` steps and after each validation.
  Its samples and draws are its own (the sampler's order, the loader's worker seeds).
- ``seeding/bare``, ``seeding/in_loader``, ``seeding/in_trainer``: microseconds per sample of the
  bare dataset's ``__getitem__`` and of ``SeededSamples.__getitem__`` over it, as a loader
  process runs it (seed the generators, get the sample) and as the training process runs it
  (``data.loader_workers: 0``: the generators' states saved and restored around the sample),
  over two epochs' keys in this process, one torch thread (the thread's CPU time: other
  processes on the machine barely change it; the wall time beside it).
- ``validation_pass/relaytrain``, ``validation_pass/dataloader``: milliseconds of one pass over
  the validation split in this process, rank 0 of 1: relaytrain's (its loader processes
  started for the pass and ended with it) and a persistent ``DataLoader``'s (the plain loop's,
  whose processes an earlier epoch started). Where relaytrain's validation share comes from.

Figures: samples/s over rank 0's first to last step (the probe of ``bench.probe``: startup and
the first step excluded) times the global batch; the share of rank 0's step time spent waiting
for data; relaytrain's validation and checkpoint shares of its report windows (the run's
``time/*``). The seeding's cost: microseconds per sample over the bare ``__getitem__``, its share
of a seeded sample's time, and (loader path) of relaytrain's step time: the seeding's CPU time
per step (per-worker batch x cost) / the step's wall time.
Target: relaytrain samples/s / DataLoader samples/s >= 1.0 at 1 and 2 workers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench import common, harness
from bench.common import REPO, Result, Sample, Target, Variant
from bench.plain_ddp import join_group, spawn
from bench.probe import StepProbe, done_event, read_probe, span
from trainer_core import step_time, storage
from trainer_core.checkpoint import optimizers, schedules, training_state
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import samples
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.batch_workload import BatchWorkload, logits_of

NAME = "datasets"
TARGET = Target(
    "samples/s, relaytrain / DataLoader",
    "samples/s of relaytrain's Dataset form / plain PyTorch DDP with a DataLoader and a "
    "DistributedSampler over the same dataset, augmentation, loader processes and batch (the "
    "lower of 1 and 2 workers)",
    ">=",
    1.0,
)
#: Images a worker trains on per step (the global batch is this times the workers).
BATCH_PER_WORKER = 64
COLUMNS = [
    "samples_per_s",
    "steps_per_s",
    "data_wait_share",
    "validation_share",
    "checkpoint_share",
    "us_per_sample",
    "pass_ms",
    "wall_s",
]
SEEDING = ("bare", "in_loader", "in_trainer")
VALIDATION = ("relaytrain", "dataloader")


def dataset_spec(
    root: Path, name: str, workers: int, epochs: int, loader_workers: int, quick: bool
) -> RunSpec:
    """``examples/image_folder.yaml`` with ``workers`` workers of ``BATCH_PER_WORKER`` each."""
    import yaml

    raw = yaml.safe_load((REPO / "examples" / "image_folder.yaml").read_text())
    raw["run"] = {"name": name, "storage": str(root), "seed": 0}
    raw["data"]["batch_size"] = BATCH_PER_WORKER * workers
    raw["data"]["loader_workers"] = loader_workers
    raw["schedule"]["epochs"] = epochs
    raw["scaling"] = {"num_workers": workers}
    if quick:
        raw["model"]["kwargs"]["width"] = 4
    return build_spec(raw)


# -- relaytrain ------------------------------------------------------------------------------


def measure_relaytrain(spec: RunSpec) -> Sample:
    started = time.time()
    harness.run_engine(spec)
    wall = time.time() - started
    sample = {**_throughput(spec, wall), **_window_shares(spec)}
    harness.remove_run(spec)
    return sample


def _window_shares(spec: RunSpec) -> Sample:
    """The shares of the run's report windows (``time/<part>``, the mean over ranks) spent in
    validation and blocked on checkpoints, and each part's milliseconds per step."""
    assert spec.run.name is not None
    run_dir = RunDirectory(storage.resolve(spec.run.storage).child(spec.run.name))
    steps, total = step_time.run_totals(read_metrics_history(run_dir))
    if not steps or not total[0]:
        return {}
    wall, parts = total[0], dict(zip(step_time.PARTS, total[1:], strict=True))
    return {
        "validation_share": parts["validation"] / wall,
        "checkpoint_share": parts["checkpoint"] / wall,
        **{f"{name}_ms_per_step": 1000 * seconds / steps for name, seconds in parts.items()},
    }


def _throughput(spec: RunSpec, wall: float, own_shares: bool = False) -> Sample:
    """Samples/s over rank 0's probed steps, and its data wait as a share of its step time;
    with ``own_shares`` (the plain side) its validation and checkpoint seconds as shares of
    its loop's (as relaytrain's report windows cover its loop)."""
    assert spec.run.name is not None and spec.data is not None
    measured = span(read_probe(spec.run.name))
    timings = done_event(spec.run.name).get("timings") or {}
    sample: Sample = {
        "samples_per_s": measured["steps_per_s"] * spec.data.batch_size,
        "steps_per_s": measured["steps_per_s"],
        "wall_s": wall,
    }
    step_s, wait_s = timings.get("step_s"), timings.get("data_wait_s")
    if step_s and wait_s is not None:
        sample["data_wait_share"] = wait_s / (step_s + wait_s)
    if step_s and measured.get("num_steps"):  # the optimizer step alone, without the data wait
        sample["step_ms"] = 1000 * step_s / measured["num_steps"]
    sample["torch_threads"] = measured["torch_threads"]
    loop_s = timings.get("loop_s") if own_shares else None
    for key in ("validation_s", "checkpoint_s") if loop_s else ():
        sample[key.replace("_s", "_share")] = timings[key] / loop_s
    for key in ("data_wait_s", "validation_s", "checkpoint_s") if loop_s else ():
        per_step = 1000 * timings[key] / measured["num_steps"]
        sample[key.replace("_s", "_ms_per_step")] = per_step
    return sample


# -- plain PyTorch: DataLoader + DistributedSampler ------------------------------------------


def measure_dataloader(spec: RunSpec, root: Path) -> Sample:
    assert spec.run.name is not None
    directory = root / spec.run.name
    directory.mkdir(parents=True, exist_ok=True)
    started = spawn(_plain_worker, spec, str(directory))
    sample = _throughput(spec, time.time() - started, own_shares=True)
    harness.remove_run(spec)
    return sample


def _plain_worker(rank: int, spec_json: dict[str, Any], port: int, out: str) -> None:
    spec = join_group(rank, spec_json, port)
    try:
        _plain_train(spec, rank, dist.get_world_size(), Path(out))
    finally:
        dist.destroy_process_group()


def _loader(dataset: Any, rank: int, world: int, batch: int, workers: int, train: bool) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=DistributedSampler(dataset, world, rank, shuffle=train, seed=0, drop_last=train),
        num_workers=workers,
        drop_last=train,
        persistent_workers=workers > 0,
        # torchrun's processes fork their loader workers, as Ray's workers fork relaytrain's
        multiprocessing_context="fork" if workers else None,
    )


def _plain_train(spec: RunSpec, rank: int, world: int, out: Path) -> None:
    assert spec.model and spec.data and spec.schedule and spec.run.name
    data, epochs = spec.data, spec.schedule.epochs
    training_state.seed_everything(spec.run.seed)
    model = workloads.build_model(spec.model, 0, 0, columns_form=True)
    ddp: torch.nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = optimizers.make_optimizer(model.parameters(), spec.optimizer)
    workload = BatchWorkload(spec)
    batch = data.batch_size // world
    assert data.validation is not None
    train = samples.build_dataset(data.dataset, data.kwargs, "data.dataset")
    held = samples.build_dataset(data.validation, data.validation_kwargs, "data.validation")
    images = _loader(train, rank, world, batch, data.loader_workers, True)
    held_out = _loader(held, rank, world, batch, data.loader_workers, False)
    scheduler = schedules.make_scheduler(optimizer, spec.schedule, len(images) * epochs)
    probe = StepProbe(spec.run.name, rank)
    step, seconds = 0, dict.fromkeys(("step_s", "data_wait_s", "validation_s", "checkpoint_s"), 0.0)
    loop_started = time.perf_counter()
    for epoch in range(epochs):
        images.sampler.set_epoch(epoch)
        ddp.train()
        waited = time.perf_counter()
        for collated in images:
            started = time.perf_counter()
            seconds["data_wait_s"] += started - waited
            step += 1
            pair = samples.as_batch(collated)
            optimizer.zero_grad(set_to_none=True)
            total, count = workload.loss(workload.forward(ddp, pair), pair)
            (total / count).backward()
            optimizer.step()
            scheduler.after_optimizer_step()
            float(total.detach())  # the loss as a number, as every loop reads it
            seconds["step_s"] += time.perf_counter() - started
            probe.stepped(step)
            if step % spec.report.every == 0:
                dist.all_reduce(torch.tensor([float(total.detach())]))
            if step % spec.checkpoint.every == 0:
                with _timed(seconds, "checkpoint_s"):
                    _checkpoint(model, optimizer, rank, out)
            waited = time.perf_counter()
        with _timed(seconds, "validation_s"):
            _validate(ddp, workload, held_out)
        with _timed(seconds, "checkpoint_s"):  # the weights the validation measured
            _checkpoint(model, optimizer, rank, out)
    probe.done(timings={**seconds, "loop_s": time.perf_counter() - loop_started})


@contextlib.contextmanager
def _timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - started


def _checkpoint(model: torch.nn.Module, optimizer: Any, rank: int, out: Path) -> None:
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, out / "checkpoint.pt")
    dist.barrier()


def _validate(model: torch.nn.Module, workload: BatchWorkload, held_out: Any) -> None:
    """The validation split's summed loss and correct labels, reduced over the ranks."""
    model.eval()
    sums = torch.zeros(3)
    with torch.no_grad():
        for collated in held_out:
            batch = samples.as_batch(collated)
            out = workload.forward(model, batch)
            total, count = workload.loss(out, batch)
            correct = (logits_of(out).argmax(-1) == batch["labels"]).sum()
            sums += torch.stack([total.float(), torch.as_tensor(count).float(), correct.float()])
    dist.all_reduce(sums)
    model.train()


# -- the seeding's cost ----------------------------------------------------------------------


class _InLoader:
    """What ``get_worker_info()`` returns in a loader process (any object: not None)."""


def measure_seeding(spec: RunSpec, how: str, num_samples: int) -> Sample:
    """Microseconds per sample of ``how`` (``SEEDING``) over ``num_samples`` keys (the
    epochs' indices in index order, from epoch 0): the thread's CPU time, which other work on
    a shared machine leaves nearly as it is, and the wall time."""
    assert spec.data is not None
    dataset = samples.build_dataset(spec.data.dataset, spec.data.kwargs, "data.dataset")
    seeded = samples.SeededSamples(dataset, spec.run.seed)
    keys = [(k // len(dataset), k % len(dataset)) for k in range(num_samples)]

    def bare(key: tuple[int, int]) -> Any:
        return dataset[key[1]]

    get: Callable[[tuple[int, int]], Any] = bare if how == "bare" else seeded.__getitem__
    for index in range(len(dataset)):  # every file read once: the page cache alike for all
        dataset[index]
    patch = (
        mock.patch.object(samples, "get_worker_info", _InLoader)
        if how == "in_loader"
        else contextlib.nullcontext()
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader process (and a 1-CPU worker)
    try:
        with patch:
            started, cpu = time.perf_counter(), time.thread_time()
            for key in keys:
                get(key)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return {
        "us_per_sample": 1e6 * cpu / num_samples,
        "wall_us_per_sample": 1e6 * wall / num_samples,
    }


# -- one validation pass ---------------------------------------------------------------------


def measure_validation_pass(spec: RunSpec, how: str, passes: int = 3) -> Sample:
    """Milliseconds per validation pass of rank 0 of 1 over the validation split: relaytrain's
    (``RankSamples.validation()``: loader processes started for each pass and ended with it)
    or the plain loop's (one persistent ``DataLoader``, after a first pass that starts its
    processes, as every epoch after the first finds them)."""
    from trainer_core.data.sample_loader import RankSamples

    data = spec.data
    assert data is not None and data.validation is not None
    train = samples.build_dataset(data.dataset, data.kwargs, "data.dataset")
    held = samples.build_dataset(data.validation, data.validation_kwargs, "data.validation")
    if how == "relaytrain":
        ranks = RankSamples(train, held, data, spec.run.seed, 1, 0)
        next_pass: Callable[[], Any] = ranks.validation
    else:
        loader = _loader(held, 0, 1, data.batch_size, data.loader_workers, False)
        next_pass = loader.__iter__
        for _ in next_pass():  # the processes start
            pass
    started = time.perf_counter()
    for _ in range(passes):
        for _ in next_pass():
            pass
    return {"pass_ms": 1000 * (time.perf_counter() - started) / passes}


# -- the benchmark ---------------------------------------------------------------------------


def variants(
    root: Path, epochs: int, loader_workers: int, num_samples: int, quick: bool
) -> list[Variant]:
    def spec(prefix: str, workers: int, rep: int) -> RunSpec:
        return dataset_spec(
            root, f"{prefix}-{workers}w-{rep}", workers, epochs, loader_workers, quick
        )

    found = [
        Variant(
            f"seeding/{how}",
            {
                "bare": "the dataset's own __getitem__, {n} samples, one thread",
                "in_loader": "SeededSamples.__getitem__ as a loader process runs it: seed the "
                "generators, then the sample",
                "in_trainer": "SeededSamples.__getitem__ in the training process (loader_workers "
                "0): the generators' states saved, seeded, the sample, the states restored",
            }[how].format(n=num_samples),
            lambda rep, how=how: measure_seeding(spec("seeding", 1, rep), how, num_samples),
        )
        for how in SEEDING
    ]
    found += [
        Variant(
            f"validation_pass/{how}",
            {
                "relaytrain": "one pass of RankSamples.validation(), rank 0 of 1: its loader "
                "processes start and end with the pass",
                "dataloader": "one pass of a persistent DataLoader over the validation split "
                "(processes started by an earlier pass)",
            }[how],
            lambda rep, how=how: measure_validation_pass(spec("validation", 1, rep), how),
        )
        for how in VALIDATION
    ]
    for workers in (1, 2):
        found += [
            Variant(
                f"relaytrain_{workers}w",
                f"engine attempt, {workers} worker(s), {loader_workers} loader processes each",
                lambda rep, w=workers: measure_relaytrain(spec("rt", w, rep)),
            ),
            Variant(
                f"dataloader_{workers}w",
                f"plain DDP, {workers} process(es), DataLoader + DistributedSampler, "
                f"{loader_workers} loader processes each",
                lambda rep, w=workers: measure_dataloader(spec("dl", w, rep), root),
            ),
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--epochs", type=int, default=None, help="epochs per run (default 8)")
    cli.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        help="loader processes per worker, both sides (default 2, the example's)",
    )
    cli.add_argument(
        "--seeding-samples",
        type=int,
        default=None,
        help="samples each seeding variant gets (default 2874: two epochs of the training split)",
    )
    args = cli.parse_args(argv)
    epochs = args.epochs or (1 if args.quick else 8)
    num_samples = args.seeding_samples or (200 if args.quick else 2874)
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.session() as (root, session):
        result.settings.update(
            session,
            epochs=epochs,
            loader_workers=args.loader_workers,
            batch_per_worker=BATCH_PER_WORKER,
            seeding_samples=num_samples,
            workload="examples/image_folder.yaml (digit PNGs, crop + jitter, small CNN)",
        )
        found = variants(root, epochs, args.loader_workers, num_samples, args.quick)
        result.variants = common.measure(found, args)
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    records = result.variants
    ratios = {
        w: common.ratio(records, f"relaytrain_{w}w", f"dataloader_{w}w", "samples_per_s")
        for w in (1, 2)
    }
    found = [r for r in ratios.values() if r is not None]
    if found:
        note = ", ".join(f"{w}w {r:.3f}" for w, r in ratios.items() if r is not None)
        result.targets.append(TARGET.check(min(found), note))
        result.figures["relaytrain/dataloader by workers"] = ratios
    passes = {
        how: records[f"validation_pass/{how}"].median("pass_ms")
        for how in VALIDATION
        if f"validation_pass/{how}" in records
    }
    if len(passes) == len(VALIDATION) and None not in passes.values():
        result.figures["validation pass ms"] = passes
        result.notes.append(
            "one validation pass, rank 0 of 1: relaytrain's {relaytrain:.0f} ms (loader "
            "processes started and ended with each pass), a persistent DataLoader's "
            "{dataloader:.0f} ms".format(**passes)
        )
    result.notes.append(
        "Ray starts its workers at nice 15 (RAY_worker_niceness), and relaytrain's loader "
        "processes are forked from them; the plain processes run at the benchmark's nice 0: "
        "on a machine that other work loads, relaytrain's side gets less of the CPU (see the "
        "load average above)"
    )
    cost = _seeding_cost(result)
    if cost:
        result.figures["seeding"] = cost
        result.notes.append(
            "seeding: {in_loader_us:.1f} us a sample in a loader process "
            "({in_loader_share:.1%} of a seeded sample's time), {in_trainer_us:.1f} us in the "
            "training process, states saved and restored ({in_trainer_share:.1%})".format(**cost)
            + "".join(
                f"; {w}w: {cost[f'step_share_{w}w']:.1%} of relaytrain's step time"
                for w in (1, 2)
                if f"step_share_{w}w" in cost
            )
        )


def _seeding_cost(result: Result) -> dict[str, float]:
    """Microseconds per sample the seeding adds in a loader process and in the training
    process, their shares of a seeded sample's time, and the loader's seeding CPU per step as a
    share of relaytrain's step time (per-worker batch x cost / seconds per step)."""
    if any(f"seeding/{how}" not in result.variants for how in SEEDING):
        return {}
    medians = {how: result.variants[f"seeding/{how}"].median("us_per_sample") for how in SEEDING}
    if None in medians.values():
        return {}
    bare = medians["bare"]
    assert bare is not None
    cost: dict[str, float] = {}
    for how in SEEDING[1:]:
        seeded = medians[how]
        assert seeded is not None
        cost[f"{how}_us"] = seeded - bare
        cost[f"{how}_share"] = (seeded - bare) / seeded
    for workers in (1, 2):
        steps_per_s = result.variants.get(f"relaytrain_{workers}w")
        rate = steps_per_s.median("steps_per_s") if steps_per_s else None
        if rate:
            cost[f"step_share_{workers}w"] = cost["in_loader_us"] * 1e-6 * BATCH_PER_WORKER * rate
    return cost


if __name__ == "__main__":
    raise SystemExit(main())
