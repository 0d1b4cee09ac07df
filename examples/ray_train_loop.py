"""A stock Ray Train loop, as in Ray's checkpointing guide: relaytrain runs it unchanged."""

import os
import tempfile

import ray.train
import ray.train.torch
import torch
from torch import nn


def train_func(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "model.pt"), weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)
    generator = torch.Generator().manual_seed(1234 + ray.train.get_context().get_world_rank())
    x = torch.randn(256, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(start_epoch, config["num_epochs"]):
        for i in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[i : i + 32]), y[i : i + 32])
            loss.backward()
            optimizer.step()
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as tmp:
            if ray.train.get_context().get_world_rank() == 0:
                torch.save(
                    {
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                    },
                    os.path.join(tmp, "model.pt"),
                )
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            else:
                ray.train.report(metrics, checkpoint=None)
