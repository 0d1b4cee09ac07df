"""Transforms, models and losses of the columns form for the tests (tests/unit/test_columns.py,
tests/integration/test_columns.py): a tiny LM dataset, good functions, and the bad ones the
setup checks must refuse (each named for what it does wrong)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from tools.make_text_parquet import rows as text_rows


def write_lm_dataset(path: Path, seq_len: int = 32, count: int = 400, group: int = 100) -> str:
    """``count`` rows of ``seq_len`` byte tokens of the pydoc corpus, ``group`` rows a row
    group, with a binary column (the row's bytes) and the row's number."""
    table = text_rows(seq_len).slice(0, count)
    tokens = np.asarray(table.column("tokens").combine_chunks().flatten()).reshape(count, -1)
    table = table.append_column("raw", pa.array([t.tobytes() for t in tokens], pa.binary()))
    table = table.append_column("n", pa.array(np.arange(count, dtype=np.int64)))
    pq.write_table(table, path, row_group_size=group)
    return str(path)


def noisy(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The row's number with a draw from its generator: what each row got, for the tests."""
    return {"n": np.int64(row["n"]), "draw": np.float64(rng.random())}


def decode_raw(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = np.frombuffer(row["raw"], dtype=np.uint8).astype(np.int64)
    return {"input_ids": ids, "labels": ids}


def crop_some_labels(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """examples.lm_gpt's random crop, with the labels of a random prefix (0 to half the window,
    drawn from ``rng``) set to -100: each sample carries its own count of labelled tokens, so
    micro-batches and ranks count unevenly."""
    from examples.lm_gpt import crop

    sample = crop(row, rng)
    labels = sample["labels"].copy()
    labels[: int(rng.integers(0, len(labels) // 2 + 1))] = -100
    return {"input_ids": sample["input_ids"], "labels": labels}


class RecordingLM(nn.Module):
    """examples.lm_gpt's GPT that records what each training forward pass saw in a worker: one
    JSON line ``{"rank", "world_size", "rows"}`` a micro-batch (``rows``: a digest of each
    sample's input ids, so the row and its augmentation) in ``log_dir/<pid>.jsonl``."""

    def __init__(self, log_dir: str, **kwargs: Any):
        from examples.lm_gpt import build

        super().__init__()
        self.inner = build(**kwargs)
        self.log_dir = log_dir

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import json
        import os

        import torch.distributed as dist

        if self.training and dist.is_initialized():
            line = {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "rows": [sample_digest(row) for row in input_ids],
            }
            with open(Path(self.log_dir) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return self.inner(input_ids)


def recording_lm(**kwargs: Any) -> nn.Module:
    return RecordingLM(**kwargs)


def sample_digest(input_ids: torch.Tensor) -> str:
    """A sample's input ids in a few bytes: which row, and which crop of it."""
    import hashlib

    return hashlib.blake2b(input_ids.numpy().tobytes(), digest_size=8).hexdigest()


def raises_on_row_2(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    if row["n"] == 2:
        raise ValueError("cannot decode this row")
    return decode_raw(row, rng)


def ignores_rng(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    ids = np.frombuffer(row["raw"], dtype=np.uint8).astype(np.int64)
    return {"input_ids": np.roll(ids, random.randrange(len(ids))), "labels": ids}


def uneven_lengths(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    ids = np.frombuffer(row["raw"], dtype=np.uint8).astype(np.int64)[: 4 + row["n"] % 5]
    return {"input_ids": ids, "labels": ids}


def returns_a_list(row: dict[str, Any], rng: np.random.Generator) -> list[int]:
    return list(row["raw"])


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def tiny_lm(**kwargs: Any) -> nn.Module:
    return TinyLM(**kwargs)


def token_loss_sum(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> Any:
    logits, labels = outputs[:, :-1].reshape(-1, outputs.shape[-1]), batch["labels"][:, 1:]
    losses = nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")
    return losses.sum(), losses.numel()


def per_token_losses(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits, labels = outputs[:, :-1].reshape(-1, outputs.shape[-1]), batch["labels"][:, 1:]
    return nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")


def sum_without_count(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> Any:
    return per_token_losses(outputs, batch).sum(), "tokens"


def noisy_batched(rows: dict[str, list[Any]], rngs: list[np.random.Generator]) -> dict[str, Any]:
    """``noisy`` for a batch: the rows' numbers and one draw from each row's generator."""
    return {
        "n": np.asarray(rows["n"], dtype=np.int64),
        "draw": np.asarray([rng.random() for rng in rngs]),
    }


def own_lm_loop(config: dict[str, Any]) -> None:
    """A loop of the user's own on relaytrain's API over the columns form: examples.lm_gpt's
    GPT on the batches ``batches()`` hands out (crops made by ``data.transform``), each
    rank's samples recorded as ``RecordingLM`` records them (``config["log_dir"]``)."""
    import json
    import os

    from examples.lm_gpt import build
    from trainer_core.train import own_loop

    run = own_loop.session()
    model = build(block_size=32, layers=1, heads=2, width=16, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model = run.setup(model, optimizer)
    for batch in run.batches():
        line = {
            "rank": run.rank,
            "world_size": run.world_size,
            "rows": [sample_digest(row) for row in batch["input_ids"]],
        }
        with open(Path(config["log_dir"]) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.report({"loss": loss.item()})


def needs_pixels(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> Any:
    """A metric written for another batch: it reads a key this one does not have."""
    return batch["pixels"].float().mean()


def image_header(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """An encoded image's first 32 bytes as tokens (a decoder reads its header first): wide
    rows (tests/integration/test_reader_memory.py) trained by ``tiny_lm`` without a 100,000-token
    sequence a row."""
    ids = np.frombuffer(row["raw"][:32], dtype=np.uint8).astype(np.int64)
    return {"input_ids": ids, "labels": ids}
