"""A stock Ray Train loop fed by Ray Data, as in Ray's data-loading guide: relaytrain passes the
spec's ``datasets`` to ``TorchTrainer(datasets=...)`` and runs the loop unchanged.

Each epoch iterates this worker's shard of ``train`` and reports, with a checkpoint, the rows
every worker trained on (summed across workers). Ray Data has no mid-epoch cursor: a resumed run
starts the epoch after its newest checkpoint from that epoch's beginning.
"""

import os
import tempfile

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn


def train_func(config):
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "model.pt"), weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)
    shard = ray.train.get_dataset_shard("train")
    context = ray.train.get_context()
    for epoch in range(start_epoch, config["num_epochs"]):
        rows, loss = 0, torch.zeros(())
        for batch in shard.iter_torch_batches(batch_size=config.get("batch_size", 64)):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(batch["pixels"]), batch["label"])
            loss.backward()
            optimizer.step()
            rows += len(batch["label"])
        seen = torch.tensor([rows], dtype=torch.int64)
        if context.get_world_size() > 1:
            dist.all_reduce(seen)
        metrics = {"epoch": epoch, "loss": loss.item(), "rows": int(seen)}
        with tempfile.TemporaryDirectory() as tmp:
            saved = None
            if context.get_world_rank() == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                if isinstance(model, nn.parallel.DistributedDataParallel):
                    state["model"] = model.module.state_dict()
                torch.save({**state, "epoch": epoch}, os.path.join(tmp, "model.pt"))
                saved = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=saved)
