"""The columns form's step in a real 2-rank gloo group: summed losses over uneven counts of
labelled tokens, accumulated over micro-batches and ranks under DDP, divided once by the
global count, give the gradients of one batch of all of them (the oracle: that batch's mean
loss, backpropagated in one process)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from tests.columns_workloads import TinyLM
from tests.unit.gloo_group import run_ranks
from trainer_core.train.batch_workload import BUILTIN_LOSSES, IGNORE
from trainer_core.train.steps import summed_gradients

#: Global batch per micro-batch, micro-batches per step, tokens per sample.
BATCH, ACCUMULATION, LENGTH = 4, 2, 6


def step_batches() -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches (global), labels masked unevenly: some samples carry 1 label,
    others 5."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(ACCUMULATION):
        ids = torch.randint(0, 256, (BATCH, LENGTH), generator=generator)
        labels = ids.clone()
        keep = (
            torch.rand((BATCH, LENGTH), generator=generator)
            < torch.linspace(0.1, 1, BATCH)[:, None]
        )
        labels[~keep] = IGNORE
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def forward_loss(model, batch):
    return BUILTIN_LOSSES["causal_lm"](model(batch["input_ids"]), batch)


def oracle() -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    model = TinyLM()
    every = step_batches()
    ids = torch.cat([b["input_ids"] for b in every])
    labels = torch.cat([b["labels"] for b in every])
    logits = model(ids)[:, :-1].reshape(-1, 256)
    loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int) -> None:
    torch.manual_seed(1)
    model = DistributedDataParallel(TinyLM())
    half = BATCH // world
    mine = [{k: v[rank * half : (rank + 1) * half] for k, v in b.items()} for b in step_batches()]
    loss = summed_gradients(model, mine, forward_loss, BATCH * ACCUMULATION, world)
    expected_loss, expected = oracle()
    assert abs(loss - expected_loss) < 1e-6 * expected_loss, (loss, expected_loss)
    for name, parameter in model.module.named_parameters():
        assert torch.allclose(parameter.grad, expected[name], rtol=1e-5, atol=1e-8), name


def test_uneven_token_counts_over_ranks_and_micro_batches_give_one_batchs_gradients():
    counts = [int((b["labels"][:, 1:] != IGNORE).sum()) for b in step_batches()]
    assert len(set(counts)) > 1 or counts[0] < BATCH * (LENGTH - 1)  # uneven, as meant
    run_ranks(_rank, 2)
