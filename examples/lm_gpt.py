"""A small GPT-style causal language model on byte-level tokens (examples/lm_gpt.yaml).

- ``build(**model.kwargs)``: the model, after nanoGPT: token and position embeddings, pre-norm
  blocks of causal self-attention (``scaled_dot_product_attention``) and an MLP, and an output
  head tied to the token embedding. ``forward(input_ids)`` returns logits ``[B, T, 256]``.
- ``gpt2(...)``: transformers' GPT-2 of the same size, from its config (examples/lm_gpt2_fsdp.yaml).
- ``tokens(row, rng)``: a row of ``examples/data/pydoc_bytes.parquet`` (``tools/
  make_text_parquet.py``) as ``input_ids`` and ``labels`` (the same ids: the built-in
  ``causal_lm`` loss lets position t predict token t + 1). ``crop`` random-crops a window of
  three quarters of the row, drawn from ``rng`` (the same window for the row at any worker
  count and after any resume, another each epoch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        layers: int = 2,
        heads: int = 4,
        width: int = 64,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.block_size = block_size
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.embed(input_ids) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(**kwargs: Any) -> GPT:
    return GPT(**kwargs)


def gpt2(
    vocab_size: int = 256,
    block_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    width: int = 64,
    dropout: float = 0.1,
) -> nn.Module:
    """HuggingFace ``transformers``' GPT-2 built from a ``GPT2Config`` (no weights downloaded):
    its output head is tied to the token embedding. It takes ``input_ids`` and
    ``attention_mask`` and returns a ``CausalLMOutputWithCrossAttentions`` whose ``logits``
    the built-in ``causal_lm`` loss reads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tokens(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A row's tokens as the model's input ids and the loss's labels."""
    ids = np.asarray(row["tokens"], dtype=np.int64)
    return {"input_ids": ids, "labels": ids}


def masked(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``tokens`` with the attention mask a HuggingFace model takes (every token attended)."""
    ids = np.asarray(row["tokens"], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}


def crop(row: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random window of three quarters of the row's tokens (the draw comes from ``rng``)."""
    ids = np.asarray(row["tokens"], dtype=np.int64)
    length = len(ids) - len(ids) // 4
    start = int(rng.integers(0, len(ids) - length + 1))
    window = ids[start : start + length]
    return {"input_ids": window, "labels": window}
