"""Precision: samples/s of the built-in loop under ``precision: fp32 | bf16 | fp16`` on CPU,
beside plain PyTorch doing the same arithmetic.

Variants, alternated in one process (one local Ray cluster), each one worker training the
compute-bound synthetic MLP (64-512x3-1, batch 128: ``bench.workload.mlp_spec``) for one epoch:
- ``relaytrain_<precision>``: one engine attempt with ``precision`` set;
- ``plain_<precision>``: ``torch.multiprocessing`` + gloo, one process, the same steps under
  the same ``torch.autocast`` (fp16 with a ``GradScaler``): what autocast itself costs or gains
  on this CPU, apart from relaytrain.

Figures: samples/s over rank 0's first to last step and from the optimizer-step time alone;
the ratios bf16/fp32 and fp16/fp32 for each. No target: the issue asks for the figure. On a
CPU without bf16 instructions (AVX-512 BF16, AMX) the bf16 and fp16 matrix multiplies take
slow generic kernels: on the 2-core AVX2 EPYC this was written on, bf16 gave 0.064 and fp16
0.057 of fp32's samples/s (2026-11-23), in relaytrain and plain PyTorch alike, which is why one
epoch is enough here. The GPU path is where autocast pays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench import common, harness
from bench.common import Result, Sample, Variant
from bench.scaling import measure_plain, measure_relaytrain
from bench.workload import QUICK_MLP, mlp_label, mlp_spec
from trainer_core.spec.run_spec import RunSpec

NAME = "precision"
PRECISIONS = ("fp32", "bf16", "fp16")
COLUMNS = ["samples_per_s", "compute_samples_per_s", "steps_per_s", "wall_s"]


def precision_spec(root: Path, name: str, precision: str, epochs: int, quick: bool) -> RunSpec:
    size = QUICK_MLP if quick else {}
    return mlp_spec(root, name, epochs=epochs, num_workers=1, precision=precision, **size)


def variants(root: Path, epochs: int, quick: bool) -> list[Variant]:
    def relaytrain(precision: str) -> Callable[[int], Sample]:
        return lambda rep: measure_relaytrain(
            precision_spec(root, f"rt-{precision}-{rep}", precision, epochs, quick)
        )

    def plain(precision: str) -> Callable[[int], Sample]:
        return lambda rep: measure_plain(
            precision_spec(root, f"plain-{precision}-{rep}", precision, epochs, quick), root
        )

    found = []
    for precision in PRECISIONS:
        found += [
            Variant(
                f"relaytrain_{precision}",
                f"engine attempt, 1 worker, precision {precision}",
                relaytrain(precision),
            ),
            Variant(
                f"plain_{precision}",
                f"torch.multiprocessing, 1 process, the same autocast ({precision})",
                plain(precision),
            ),
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    args = cli.parse_args(argv)
    epochs = args.epochs
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.session() as (root, session):
        result.settings.update(
            session,
            workload=mlp_label(args.quick),
            epochs=epochs,
            num_workers=1,
            batch_size=precision_spec(root, "x", "fp32", epochs, args.quick).data.batch_size,  # type: ignore[union-attr]
        )
        result.variants = common.measure(variants(root, epochs, args.quick), args)
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    for prefix in ("relaytrain", "plain"):
        for precision in PRECISIONS[1:]:
            for metric in ("samples_per_s", "compute_samples_per_s"):
                value = common.ratio(
                    result.variants, f"{prefix}_{precision}", f"{prefix}_fp32", metric
                )
                label = f"{prefix} {precision}/fp32 {metric}"
                result.figures[label] = value
                if value is not None and metric == "samples_per_s":
                    result.notes.append(f"{label}: {value:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
