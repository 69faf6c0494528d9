"""The small models lesson 2 trains: an MLP with a choice of norm, a tiny token model, a tiny Llama."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.errors import UserError
from course_lib.validate import Count, checked


def group_count(channels: int, preferred: int = 32) -> int:
    """The GroupNorm group count for `channels`: the largest <= preferred with >= 2 channels per group."""
    for g in range(min(preferred, channels), 0, -1):
        if channels % g == 0 and channels // g >= 2 or g == 1:
            return g
    return 1


def _norm_layer(norm: str | None, width: int) -> nn.Module:
    if norm is None or norm == "none":
        return nn.Identity()
    if norm == "layer":
        return nn.LayerNorm(width)
    if norm == "batch":
        return nn.BatchNorm1d(width)
    if norm == "group":
        return nn.GroupNorm(group_count(width), width)
    raise UserError(f"unknown norm {norm!r}: use None, 'layer', 'batch' or 'group'")


@checked
def tiny_mlp(
    norm: str | None = "layer",
    in_features: Count = 8,
    hidden: Count = 16,
    out_features: Count = 4,
    depth: Count = 2,
    seed: int | None = 0,
) -> nn.Sequential:
    """A small MLP with an optional norm after each hidden Linear: None, 'layer', 'batch', 'group'.

    The same `seed` gives the same weights whatever the norm (lesson 2, "the BatchNorm failure").
    """
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), _norm_layer(norm, hidden), nn.Tanh()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


@checked
class TinyTokenLM(nn.Module):
    """A tiny causal language model: each position sees its token and the previous one (lesson 2).

    Embedding, a previous-token mix, LayerNorm, an MLP and an output head: per-token losses that
    depend on the other tokens of the sequence but never on the other sequences of the batch, which
    is what exact accumulation needs. `norm="batch"` swaps the LayerNorm for a BatchNorm over all
    token positions (padding included), which breaks that.
    """

    def __init__(
        self, vocab_size: Count = 32, dim: Count = 16, norm: str | None = "layer", seed: int | None = 0
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.norm = _norm_layer(norm, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        previous = F.pad(x, (0, 0, 1, 0))[:, :-1]
        h = torch.tanh(self.mix(torch.cat([x, previous], dim=-1)))
        if isinstance(self.norm, nn.BatchNorm1d):
            h = self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        else:
            h = self.norm(h)
        h = h + self.mlp(h)
        return self.head(h)


@checked
def tiny_causal_lm_config(vocab_size: Count = 64, hidden_size: Count = 32, layers: Count = 2, heads: Count = 4):
    """A tiny Llama config (random weights, no download) for the Trainer cross-check (lesson 2)."""
    from transformers import LlamaConfig  # off the import path: transformers takes seconds to import

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
