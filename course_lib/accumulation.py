"""Gradient accumulation done right, measured (lesson 2).

Accumulating K micro-batches gives the gradient of the whole batch only when every micro-batch's
loss is divided by the item count of the whole window (tokens, for a token loss), and only for models
whose per-item loss does not depend on the other items of the batch (no BatchNorm in training mode).
This module measures both claims (`compare_accumulation`), compares the BatchNorm remedies
(`compare_batchnorm_remedies`), provides a reference training loop that gets every detail right
(`train_with_accumulation`, with each classic mistake available by name in `MISTAKES` so that a
lesson can show what it breaks), cross-checks it against Hugging Face's Trainer and a 2-process DDP
run, and measures what accumulation costs (`measure_accumulation_cost`).

Batches are either a tuple `(inputs, targets)` (a per-sample loss, `SampleLoss`) or a dict with
`input_ids`, `attention_mask` and `labels` (a next-token loss over the labels that are not
`ignore_index`, `TokenLoss`).
"""

from __future__ import annotations

import contextlib
import copy
import html
import math
import os
import re
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.measure import format_bytes, optimizer_state_tensors, peak_bytes, SavedTensorRecorder, storage_bytes

IGNORE_INDEX = -100

Batch = Any  # a tuple (inputs, targets) or a dict of tensors (input_ids, attention_mask, labels)


# --------------------------------------------------------------------------------------------------
# Losses as (sum over items, item count): the two numbers accumulation needs
# --------------------------------------------------------------------------------------------------

class SampleLoss:
    """A per-sample loss on `(inputs, targets)` batches; the items are the samples (lesson 2).

    `sum(model, batch)` is the sum over samples of each sample's loss (for "mse" the mean over the
    output features of one sample); `count(batch)` is the number of samples. The loss of a batch is
    `sum / count`.
    """

    def __init__(self, criterion: str = "mse") -> None:
        if criterion not in ("mse", "cross_entropy"):
            raise ValueError(f"unknown criterion {criterion!r}: use 'mse' or 'cross_entropy'")
        self.criterion = criterion

    def count(self, batch: Batch) -> int:
        return int(batch[0].shape[0])

    def sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        out = model(inputs)
        if self.criterion == "cross_entropy":
            return F.cross_entropy(out, targets, reduction="sum")
        return F.mse_loss(out, targets, reduction="none").flatten(1).mean(1).sum()

    def __repr__(self) -> str:
        return f"SampleLoss({self.criterion!r})"


class TokenLoss:
    """Next-token cross-entropy over the valid labels of a padded token batch (lesson 2).

    The items are the target tokens: `labels[:, 1:] != ignore_index` (the prediction at position t
    targets the label at t + 1, as in Hugging Face causal LMs). `sum` is the summed cross-entropy
    over those tokens, computed in float32 at least (half-precision logits are upcast first, as
    Hugging Face does); `count` is their number, computed from the labels alone so that a loop can
    know a window's count before any forward pass.
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def count(self, batch: Batch) -> int:
        return int((batch["labels"][:, 1:] != self.ignore_index).sum())

    def sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
        logits = getattr(out, "logits", out)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        labels = batch["labels"][:, 1:].reshape(-1).to(logits.device)
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum")

    def __repr__(self) -> str:
        return f"TokenLoss(ignore_index={self.ignore_index})"


def default_loss(batch: Batch) -> SampleLoss | TokenLoss:
    """`TokenLoss` for a dict batch with labels, `SampleLoss("mse")` for a tuple batch."""
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise ValueError("a dict batch needs 'labels' (with ignore_index at padding) for TokenLoss")
        return TokenLoss()
    return SampleLoss("mse")


# --------------------------------------------------------------------------------------------------
# Batches: split, concatenate, cast, generate
# --------------------------------------------------------------------------------------------------

def batch_size(batch: Batch) -> int:
    """Number of rows (samples or sequences) of a batch."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.shape[0])


def check_accumulation_steps(k: Any) -> int:
    """Validate an accumulation step count: a positive int, else a clear error (lesson 2)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"accumulation steps must be an int, got {type(k).__name__} {k!r}")
    if k <= 0:
        raise ValueError(f"accumulation steps must be >= 1, got {k}: K micro-batches per optimizer step")
    return k


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split a batch into `k` micro-batches along the first dimension (lesson 2).

    Sizes differ by at most one row (`torch.tensor_split`). `k` larger than the batch would leave
    empty micro-batches: that is an error, not a silent no-op.
    """
    k = check_accumulation_steps(k)
    n = batch_size(batch)
    if k > n:
        raise ValueError(f"cannot split a batch of {n} rows into {k} micro-batches: K must be <= the batch size")
    if isinstance(batch, dict):
        parts = {key: torch.tensor_split(value, k) for key, value in batch.items()}
        return [{key: parts[key][i] for key in batch} for i in range(k)]
    columns = [torch.tensor_split(t, k) for t in batch]
    return [tuple(column[i] for column in columns) for i in range(k)]


def concat_batches(batches: Sequence[Batch], pad_token_id: int = 0,
                   ignore_index: int = IGNORE_INDEX) -> Batch:
    """Concatenate micro-batches into one batch; token batches are right-padded to a common length."""
    if not batches:
        raise ValueError("nothing to concatenate")
    if isinstance(batches[0], dict):
        length = max(b["input_ids"].shape[1] for b in batches)
        fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": ignore_index}
        out = {}
        for key in batches[0]:
            parts = [F.pad(b[key], (0, length - b[key].shape[1]), value=fill.get(key, 0)) for b in batches]
            out[key] = torch.cat(parts)
        return out
    return tuple(torch.cat(column) for column in zip(*batches))


def cast_batch(batch: Batch, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Batch:
    """Move a batch to `device` and cast its floating tensors to `dtype` (integer tensors keep theirs)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t
    if isinstance(batch, dict):
        return {key: move(value) for key, value in batch.items()}
    return tuple(move(t) for t in batch)


def padded_token_examples(n: int, vocab_size: int = 32, max_len: int = 12, min_len: int = 2,
                          seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` random token sequences of random lengths in [min_len, max_len] (lesson 2, generated data).

    Each example is a dict with `input_ids` and `labels` (a copy: the model learns to predict the
    next token). Token 0 is reserved for padding and never drawn.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    examples = []
    for length in lengths.tolist():
        ids = torch.randint(1, vocab_size, (length,), generator=gen)
        examples.append({"input_ids": ids, "labels": ids.clone()})
    return examples


def collate_padded(examples: Sequence[dict[str, Any]], pad_token_id: int = 0,
                   ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """Right-pad variable-length examples to the longest one: input_ids, attention_mask, labels.

    Padding positions get `pad_token_id`, attention 0 and label `ignore_index`, so that they count
    neither in the loss nor in the item count.
    """
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), ignore_index, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = torch.as_tensor(example["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = torch.as_tensor(example.get("labels", example["input_ids"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def padded_token_batches(n_batches: int, batch_size: int = 4, vocab_size: int = 32, max_len: int = 12,
                         min_len: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n_batches` padded token micro-batches of `batch_size` random-length sequences (lesson 2)."""
    examples = padded_token_examples(n_batches * batch_size, vocab_size, max_len, min_len, seed)
    return [collate_padded(examples[i * batch_size:(i + 1) * batch_size]) for i in range(n_batches)]


def regression_batches(n_batches: int, batch_size: int = 4, in_features: int = 8, out_features: int = 4,
                       seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` random `(inputs, targets)` micro-batches for a per-sample loss (lesson 2)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, in_features, generator=gen), torch.randn(batch_size, out_features, generator=gen))
            for _ in range(n_batches)]


# --------------------------------------------------------------------------------------------------
# Small models for the lesson
# --------------------------------------------------------------------------------------------------

def _norm_layer(norm: str | None, width: int) -> nn.Module:
    if norm is None or norm == "none":
        return nn.Identity()
    if norm == "layer":
        return nn.LayerNorm(width)
    if norm == "batch":
        return nn.BatchNorm1d(width)
    if norm == "group":
        return nn.GroupNorm(_groups(width), width)
    raise ValueError(f"unknown norm {norm!r}: use None, 'layer', 'batch' or 'group'")


def tiny_mlp(norm: str | None = "layer", in_features: int = 8, hidden: int = 16, out_features: int = 4,
             depth: int = 2, seed: int | None = 0) -> nn.Sequential:
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


class TinyTokenLM(nn.Module):
    """A tiny causal language model: each position sees its token and the previous one (lesson 2).

    Embedding, a previous-token mix, LayerNorm, an MLP and an output head: per-token losses that
    depend on the other tokens of the sequence but never on the other sequences of the batch, which
    is what exact accumulation needs. `norm="batch"` swaps the LayerNorm for a BatchNorm over all
    token positions (padding included), which breaks that.
    """

    def __init__(self, vocab_size: int = 32, dim: int = 16, norm: str | None = "layer", seed: int | None = 0) -> None:
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


def tiny_causal_lm_config(vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, heads: int = 4):
    """A tiny Llama config (random weights, no download) for the Trainer cross-check (lesson 2)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=128, attention_dropout=0.0, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _check_no_dropout(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ValueError(f"{name or 'the model'} is Dropout(p={module.p}): the whole batch and the micro-batches "
                             "would draw different masks, so the comparison would measure randomness. Set p=0.")


# --------------------------------------------------------------------------------------------------
# compare_accumulation: one batch whole vs as K micro-batches
# --------------------------------------------------------------------------------------------------

@dataclass
class GradientDiff:
    """Largest gradient difference of one parameter: whole batch vs accumulated."""

    name: str
    max_abs: float   # max |g_acc - g_whole|
    max_rel: float   # max_abs / max |g_whole|, see `compare_accumulation`
    exact_zero: bool = False  # the whole-batch gradient is zero up to rounding (measured against the model's)


@dataclass
class BufferDiff:
    """A buffer (running mean/var, num_batches_tracked) after the whole batch vs after accumulation."""

    name: str
    whole: float | int   # the value for a scalar buffer, else the max |value|
    accumulated: float | int
    max_abs: float


@dataclass
class DtypeComparison:
    """What `compare_accumulation` measured in one dtype."""

    dtype: str
    loss_whole: float
    loss_accumulated: float
    gradients: list[GradientDiff]
    buffers: list[BufferDiff]

    @property
    def max_rel_grad(self) -> float:
        return max((g.max_rel for g in self.gradients), default=0.0)

    @property
    def max_abs_grad(self) -> float:
        return max((g.max_abs for g in self.gradients), default=0.0)

    @property
    def max_buffer_diff(self) -> float:
        return max((b.max_abs for b in self.buffers), default=0.0)

    @property
    def max_running_stat_diff(self) -> float:
        """Largest difference of a floating buffer (running mean/var), num_batches_tracked excluded."""
        return max((b.max_abs for b in self.buffers if not b.name.endswith("num_batches_tracked")), default=0.0)

    @property
    def batches_tracked(self) -> tuple[int, int] | None:
        """num_batches_tracked of the first BatchNorm: (whole batch, accumulated), None without BatchNorm."""
        for b in self.buffers:
            if b.name.endswith("num_batches_tracked"):
                return int(b.whole), int(b.accumulated)
        return None


_SUMMARY_HEADER = ("dtype", "max rel grad diff", "max abs grad diff", "max running-stat diff",
                   "num_batches_tracked whole / acc.", "loss whole / accumulated")


@dataclass
class AccumulationReport:
    """Result of `compare_accumulation` (lesson 2, "the proof, checked")."""

    k: int
    normalization: str
    micro_batch_rows: list[int]
    micro_batch_items: list[int]
    comparisons: dict[str, DtypeComparison]

    def __getitem__(self, dtype: str | torch.dtype) -> DtypeComparison:
        return self.comparisons[str(dtype).replace("torch.", "")]

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = []
        for name, c in self.comparisons.items():
            tracked = c.batches_tracked
            rows.append((name, f"{c.max_rel_grad:.2e}", f"{c.max_abs_grad:.2e}", f"{c.max_running_stat_diff:.3g}",
                         "-" if tracked is None else f"{tracked[0]} / {tracked[1]}",
                         f"{c.loss_whole:.6f} / {c.loss_accumulated:.6f}"))
        return rows

    def __str__(self) -> str:
        lines = [f"Whole batch vs {self.k} micro-batches ({self.normalization} normalisation), "
                 f"rows per micro-batch {self.micro_batch_rows}, items {self.micro_batch_items}"]
        header = _SUMMARY_HEADER
        lines.append("  " + " | ".join(header))
        for row in self.summary_rows():
            lines.append("  " + " | ".join(row))
        return "\n".join(lines)

    def buffer_table(self, dtype: str | torch.dtype = "float32") -> str:
        """Every buffer after the whole batch and after accumulation (max |value| for a tensor)."""
        lines = [f"{'buffer':<28} {'whole':>12} {'accumulated':>12} {'max diff':>10}"]
        for b in self[dtype].buffers:
            lines.append(f"{b.name:<28} {b.whole:>12.6g} {b.accumulated:>12.6g} {b.max_abs:>10.3g}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in _SUMMARY_HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self.summary_rows())
        caption = html.escape(f"Whole batch vs {self.k} micro-batches ({self.normalization} normalisation)")
        return f"<table><caption>{caption}</caption><tr>{head}</tr>{body}</table>"


def _max_abs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _relative(diff: float, reference: float) -> float:
    if reference == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / reference


def micro_batch_losses(loss: SampleLoss | TokenLoss, normalization: str, counts: Sequence[int],
                       k_configured: int | None = None) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """How each micro-batch's loss sum is turned into the loss that is backpropagated (lesson 2).

    `global`: sum / (item count of the whole window): exact. `naive`: sum / own count / number of
    micro-batches (the mean of per-micro-batch means): wrong when counts differ. An empty micro-batch
    under `naive` is an error (its mean is 0/0), never a NaN.
    """
    total = sum(counts)
    k = k_configured or len(counts)
    if normalization == "global":
        if total == 0:
            raise ValueError("the window has no valid items (every label is ignore_index): "
                             "its mean loss is 0/0; drop the window or fix the labels")
        return [lambda s: s / total for _ in counts]
    if normalization == "naive":
        for i, n in enumerate(counts):
            if n == 0:
                raise ValueError(f"micro-batch {i} has no valid items: its own mean loss is 0/0 (NaN); "
                                 "the global normalisation (sum / window count) has no such problem")
        return [lambda s, n=n: s / n / k for n in counts]
    raise ValueError(f"unknown normalization {normalization!r}: use 'global' or 'naive'")


def compare_accumulation(model: nn.Module, batch: Batch, k: int, loss: SampleLoss | TokenLoss | None = None, *,
                         normalization: str = "global",
                         dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
                         train: bool = True) -> AccumulationReport:
    """Run `batch` whole and as `k` micro-batches from the same initial state; compare (lesson 2).

    For each dtype, two deep copies of `model` (cast to that dtype; `model` itself is untouched) get
    the gradient of the batch: one in a single forward/backward, one accumulated over `k`
    micro-batches (`split_batch`). Reported per parameter: the largest absolute difference of the
    gradients and the relative one, `max |g_acc - g_whole| / max |g_whole|`. A parameter whose
    whole-batch gradient is zero up to rounding (below sqrt(eps) times the model's largest gradient
    entry: the bias of a Linear right before a BatchNorm, whose exact gradient is 0) has no scale of
    its own, so its difference is divided by the model's largest gradient entry instead
    (`GradientDiff.exact_zero`). Per buffer (BatchNorm running mean/var, num_batches_tracked): both
    values and their largest difference.

    `normalization="global"` divides each micro-batch's loss sum by the item count of the whole
    batch (exact); `"naive"` averages per-micro-batch means (the padded-token bug).

    Errors (never a silent NaN): `k` <= 0 or larger than the batch, a batch with no valid item,
    a micro-batch with no valid item under `"naive"`, Dropout with p > 0.
    """
    k = check_accumulation_steps(k)
    loss = loss if loss is not None else default_loss(batch)
    if train:
        _check_no_dropout(model)
    micro = split_batch(batch, k)
    counts = [loss.count(mb) for mb in micro]
    whole_count = loss.count(batch)
    if whole_count == 0:
        raise ValueError("the batch has no valid items (every label is ignore_index): its mean loss is 0/0, "
                         "so there is no gradient to compare")
    scales = micro_batch_losses(loss, normalization, counts)
    comparisons = {}
    for dtype in dtypes:
        comparisons[str(dtype).replace("torch.", "")] = _compare_in_dtype(
            model, batch, micro, loss, scales, whole_count, dtype, train)
    return AccumulationReport(k=k, normalization=normalization, micro_batch_rows=[batch_size(mb) for mb in micro],
                              micro_batch_items=counts, comparisons=comparisons)


def _compare_in_dtype(model, batch, micro, loss, scales, whole_count, dtype, train) -> DtypeComparison:
    device = next(model.parameters()).device
    whole_model = copy.deepcopy(model).to(dtype)
    acc_model = copy.deepcopy(model).to(dtype)
    for m in (whole_model, acc_model):
        m.train(train)
        m.zero_grad(set_to_none=True)
    whole_loss = loss.sum(whole_model, cast_batch(batch, dtype, device)) / whole_count
    whole_loss.backward()
    acc_loss = 0.0
    for mb, scale in zip(micro, scales):
        part = scale(loss.sum(acc_model, cast_batch(mb, dtype, device)))
        part.backward()
        acc_loss += float(part.detach())
    pairs = []
    acc_params = dict(acc_model.named_parameters())
    for name, p in whole_model.named_parameters():
        q = acc_params[name]
        if p.grad is None and q.grad is None:
            continue
        g_whole = p.grad if p.grad is not None else torch.zeros_like(p)
        g_acc = q.grad if q.grad is not None else torch.zeros_like(q)
        pairs.append((name, _max_abs(g_acc - g_whole), _max_abs(g_whole)))
    largest = max((scale for _, _, scale in pairs), default=0.0)
    floor = largest * math.sqrt(torch.finfo(dtype).eps)
    gradients = []
    for name, diff, scale in pairs:
        exact_zero = scale <= floor
        gradients.append(GradientDiff(name, diff, _relative(diff, largest if exact_zero else scale), exact_zero))
    buffers = []
    acc_buffers = dict(acc_model.named_buffers())
    for name, b in whole_model.named_buffers():
        a = acc_buffers[name]
        if b.numel() == 1:
            whole_value, acc_value = b.item(), a.item()
        else:
            whole_value, acc_value = _max_abs(b), _max_abs(a)
        diff = _max_abs(a.double() - b.double())
        buffers.append(BufferDiff(name, whole_value, acc_value, diff))
    return DtypeComparison(str(dtype).replace("torch.", ""), float(whole_loss.detach()), acc_loss, gradients, buffers)


# --------------------------------------------------------------------------------------------------
# BatchNorm remedies
# --------------------------------------------------------------------------------------------------

_BN = nn.modules.batchnorm._BatchNorm


def _groups(channels: int, preferred: int = 32) -> int:
    for g in range(min(preferred, channels), 0, -1):
        if channels % g == 0 and channels // g >= 2 or g == 1:
            return g
    return 1


def _replace_modules(model: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        replacement = make(module)
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
    return model


def replace_batchnorm(model: nn.Module, kind: str = "group", num_groups: int | None = None) -> nn.Module:
    """A copy of `model` with every BatchNorm replaced by a per-sample norm (lesson 2, remedy 1).

    `kind="group"`: GroupNorm(num_groups, C); `kind="layer"`: GroupNorm(1, C), i.e. LayerNorm over all
    non-batch dimensions with a per-channel affine. The affine weight and bias are copied; running
    statistics disappear (there are none). Fixes: accumulation becomes exact, train and eval behave
    the same. Does not fix: it is a different model (pretrained BatchNorm statistics are dropped and
    accuracy can change); it must be trained (or fine-tuned) that way.
    """
    if kind not in ("group", "layer"):
        raise ValueError(f"unknown kind {kind!r}: use 'group' or 'layer'")

    def make(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, _BN):
            return None
        c = module.num_features
        groups = 1 if kind == "layer" else (num_groups or _groups(c))
        norm = nn.GroupNorm(groups, c, eps=module.eps, affine=module.affine)
        if module.affine:
            with torch.no_grad():
                norm.weight.copy_(module.weight)
                norm.bias.copy_(module.bias)
        return norm.to(device=module.weight.device if module.affine else None)

    return _replace_modules(model, make)


class _GhostMixin:
    virtual_batch_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.shape[0] <= self.virtual_batch_size:
            return super().forward(x)
        return torch.cat([super(_GhostMixin, self).forward(chunk) for chunk in x.split(self.virtual_batch_size)])


class GhostBatchNorm1d(_GhostMixin, nn.BatchNorm1d):
    """BatchNorm1d that normalises each chunk of `virtual_batch_size` rows on its own (ghost batches)."""


class GhostBatchNorm2d(_GhostMixin, nn.BatchNorm2d):
    """BatchNorm2d that normalises each chunk of `virtual_batch_size` rows on its own (ghost batches)."""


class _FrozenStatsMixin:
    def train(self, mode: bool = True):
        return super().train(False)


class FrozenStatsBatchNorm1d(_FrozenStatsMixin, nn.BatchNorm1d):
    """BatchNorm1d that always normalises with its running statistics; weight and bias still train."""


class FrozenStatsBatchNorm2d(_FrozenStatsMixin, nn.BatchNorm2d):
    """BatchNorm2d that always normalises with its running statistics; weight and bias still train."""


def _retype(module: nn.Module, cls: type, **attrs) -> nn.Module:
    new = copy.deepcopy(module)
    new.__class__ = cls
    for key, value in attrs.items():
        setattr(new, key, value)
    return new


_GHOST = {nn.BatchNorm1d: GhostBatchNorm1d, nn.BatchNorm2d: GhostBatchNorm2d}
_FROZEN = {nn.BatchNorm1d: FrozenStatsBatchNorm1d, nn.BatchNorm2d: FrozenStatsBatchNorm2d}


def ghost_batchnorm(model: nn.Module, virtual_batch_size: int) -> nn.Module:
    """A copy of `model` whose BatchNorms use ghost batches of `virtual_batch_size` rows (remedy 2a).

    Ghost batch normalisation (Hoffer et al. 2017) normalises every chunk of `virtual_batch_size`
    rows with that chunk's statistics, and updates the running statistics once per chunk. With
    `virtual_batch_size` equal to the micro-batch size, the whole batch and its accumulation compute
    the same thing: gradients and running statistics agree. Fixes: accumulation is exactly "the
    same model on the whole batch", so the effective batch can change without changing the result.
    Does not fix: the statistics still come from `virtual_batch_size` rows (noisy when that is small),
    not from the effective batch; it is not what plain BatchNorm on the whole batch computes.
    """
    if virtual_batch_size < 1:
        raise ValueError("virtual_batch_size must be >= 1")

    def make(module: nn.Module) -> nn.Module | None:
        cls = _GHOST.get(type(module))
        return _retype(module, cls, virtual_batch_size=virtual_batch_size) if cls else None

    return _replace_modules(model, make)


@torch.no_grad()
def freeze_batchnorm_stats(model: nn.Module, calibration_batches: Iterable[Batch] | None = None,
                           forward: Callable[[nn.Module, Batch], Any] | None = None) -> nn.Module:
    """A copy of `model` whose BatchNorms normalise with running statistics, frozen (remedy 2b).

    With `calibration_batches`, the running statistics are first re-estimated over them (cumulative
    average, in training mode, no gradients); `forward(model, batch)` runs one batch (default:
    `model(batch[0])` for a tuple, `model(**batch)` minus labels for a dict). Then every BatchNorm
    stays in eval mode even under `model.train()`: each sample is normalised independently of the
    others, so accumulation is exact and the statistics never change. Fixes: exact equivalence, no
    dependence on the micro-batch size. Does not fix: the statistics are stale: they do not follow
    the features as the weights change (fine for fine-tuning, wrong for training from scratch).
    """
    model = copy.deepcopy(model)
    if calibration_batches is not None:
        bns = [m for m in model.modules() if isinstance(m, _BN)]
        saved = [(m, m.momentum) for m in bns]
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        was_training = model.training
        model.train()
        for batch in calibration_batches:
            if forward is not None:
                forward(model, batch)
            elif isinstance(batch, dict):
                model(**{key: value for key, value in batch.items() if key != "labels"})
            else:
                model(batch[0])
        for m, momentum in saved:
            m.momentum = momentum
        model.train(was_training)

    def make(module: nn.Module) -> nn.Module | None:
        cls = _FROZEN.get(type(module))
        if cls is None:
            return None
        new = _retype(module, cls)
        new.training = False
        return new

    return _replace_modules(model, make)


@dataclass
class RemedyRow:
    """One BatchNorm remedy, measured with `compare_accumulation` in float64."""

    remedy: str
    max_rel_grad: float
    max_running_stat_diff: float
    batches_tracked: str   # "whole / accumulated"
    fixes: str
    does_not_fix: str
    vs_batchnorm_whole: float = 0.0  # its whole-batch gradient vs plain BatchNorm's (relative to the largest entry)


@dataclass
class RemedyReport:
    """The BatchNorm remedies side by side (lesson 2, "BatchNorm remedies")."""

    k: int
    rows: list[RemedyRow]

    def row(self, remedy: str) -> RemedyRow:
        for r in self.rows:
            if r.remedy == remedy:
                return r
        raise KeyError(remedy)

    def __str__(self) -> str:
        lines = [f"BatchNorm and {self.k}-step accumulation (float64)"]
        for r in self.rows:
            lines.append(f"- {r.remedy}: max rel grad diff {r.max_rel_grad:.1e}, running-stat diff "
                         f"{r.max_running_stat_diff:.1e}, num_batches_tracked {r.batches_tracked}, "
                         f"whole-batch gradient vs plain BatchNorm {r.vs_batchnorm_whole:.1e}\n"
                         f"    fixes: {r.fixes}\n    does not fix: {r.does_not_fix}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("remedy", "max rel grad diff", "running-stat diff",
                                                  "num_batches_tracked whole / acc.",
                                                  "whole-batch gradient vs plain BatchNorm", "fixes", "does not fix"))
        body = "".join(
            f"<tr><td>{html.escape(r.remedy)}</td><td>{r.max_rel_grad:.1e}</td><td>{r.max_running_stat_diff:.1e}</td>"
            f"<td>{html.escape(r.batches_tracked)}</td><td>{r.vs_batchnorm_whole:.1e}</td>"
            f"<td style='text-align:left'>{html.escape(r.fixes)}</td>"
            f"<td style='text-align:left'>{html.escape(r.does_not_fix)}</td></tr>" for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"


REMEDY_NOTES = {
    "BatchNorm (no remedy)": ("nothing", "gradients and running statistics both depend on the micro-batch"),
    "GroupNorm instead": ("exact accumulation; no running statistics; same in train and eval",
                          "a different model: BatchNorm weights/statistics do not carry over, accuracy may change"),
    "LayerNorm instead (GroupNorm(1, C))": ("exact accumulation; no running statistics; same in train and eval",
                                            "a different model, as for GroupNorm"),
    "ghost batches of the micro-batch size": (
        "accumulation equals the whole batch computed with ghost batches: gradients and running statistics agree",
        "statistics still come from one micro-batch (noisy when small), not from the effective batch"),
    "frozen statistics": ("exact accumulation; statistics no longer depend on the micro-batch",
                          "statistics are stale: they do not follow the features as training changes them"),
}


def _running_stats(c: DtypeComparison) -> tuple[float, str]:
    stat = max((b.max_abs for b in c.buffers if not b.name.endswith("num_batches_tracked")), default=0.0)
    tracked = [b for b in c.buffers if b.name.endswith("num_batches_tracked")]
    text = f"{tracked[0].whole} / {tracked[0].accumulated}" if tracked else "none"
    return stat, text


def compare_batchnorm_remedies(model: nn.Module, batch: Batch, k: int,
                               loss: SampleLoss | TokenLoss | None = None,
                               dtype: torch.dtype = torch.float64) -> RemedyReport:
    """Measure the BatchNorm failure and each remedy on the same model and batch (lesson 2).

    For each variant: how far accumulation is from its own whole batch (gradients, running
    statistics, num_batches_tracked), and how far its whole-batch gradient is from plain BatchNorm's
    on the whole batch (the large-batch computation no remedy reproduces). `model` must contain
    BatchNorm layers. The batch's rows must split evenly into `k` micro-batches (ghost batches have one
    size). Frozen statistics are calibrated on the batch itself first.
    """
    k = check_accumulation_steps(k)
    if not any(isinstance(m, _BN) for m in model.modules()):
        raise ValueError("the model has no BatchNorm layer: nothing to remedy")
    n = batch_size(batch)
    if k > n or n % k:
        raise ValueError(f"the batch of {n} rows must split evenly into k={k} micro-batches")
    variants = [
        ("BatchNorm (no remedy)", model),
        ("GroupNorm instead", replace_batchnorm(model, "group")),
        ("LayerNorm instead (GroupNorm(1, C))", replace_batchnorm(model, "layer")),
        ("ghost batches of the micro-batch size", ghost_batchnorm(model, n // k)),
        ("frozen statistics", freeze_batchnorm_stats(model, [batch])),
    ]
    loss = loss if loss is not None else default_loss(batch)
    reference = _whole_batch_gradients(model, batch, loss, dtype)
    scale = max((_max_abs(g) for g in reference.values()), default=0.0) or 1.0
    rows = []
    for name, variant in variants:
        c = compare_accumulation(variant, batch, k, loss, dtypes=(dtype,))[dtype]
        stat, tracked = _running_stats(c)
        fixes, does_not = REMEDY_NOTES[name]
        grads = _whole_batch_gradients(variant, batch, loss, dtype)
        vs_bn = max(_max_abs(grads[n] - reference[n]) for n in reference) / scale
        rows.append(RemedyRow(name, c.max_rel_grad, stat, tracked, fixes, does_not, vs_bn))
    return RemedyReport(k, rows)


def _whole_batch_gradients(model: nn.Module, batch: Batch, loss, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model).to(dtype).train()
    m.zero_grad(set_to_none=True)
    (loss.sum(m, cast_batch(batch, dtype, _model_device(m))) / loss.count(batch)).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in m.named_parameters()}


# --------------------------------------------------------------------------------------------------
# The reference training loop
# --------------------------------------------------------------------------------------------------

MISTAKES: dict[str, str] = {
    "mean_per_micro_batch": "each micro-batch's own mean loss, averaged over the window (the padded-token bug "
                            "of the Hugging Face Trainer, fixed in October 2024)",
    "divide_by_configured_k": "each micro-batch's mean divided by the configured accumulation steps, also in a "
                              "short final window",
    "no_step_after_short_window": "steps only when (i + 1) % K == 0, so a short final window is never applied",
    "optimizer_step_per_micro_batch": "the optimizer stepped (and gradients zeroed) after every micro-batch: "
                                      "no accumulation at all",
    "scheduler_per_micro_batch": "the learning-rate scheduler stepped after every micro-batch",
    "clip_before_last_micro_batch": "gradients clipped after every micro-batch, i.e. partial sums clipped",
    "clip_before_unscale": "with a GradScaler, clipping the still-scaled gradients, then unscaling",
    "zero_grad_to_zero": "zero_grad(set_to_none=False): gradient memory kept and filled with zeros",
    "never_zero_grad": "gradients never reset: each window adds to the previous windows' gradients",
    "sync_every_micro_batch": "under DDP, no no_sync(): an all-reduce after every micro-batch",
    "never_sync": "under DDP, no_sync() around every micro-batch, the last too: ranks never agree",
    "count_per_rank": "under DDP, each rank divides by its own item count instead of the global one",
}


@dataclass
class TrainResult:
    """What `train_with_accumulation` did (lesson 2, "the reference loop")."""

    windows: int = 0           # windows seen (optimizer steps attempted)
    steps: int = 0             # optimizer steps applied
    skipped_steps: int = 0     # steps GradScaler skipped (inf/NaN gradients); the scheduler did not step
    empty_windows: int = 0     # windows with no valid item, skipped (empty_window="skip")
    micro_batches: int = 0
    losses: list[float] = field(default_factory=list)    # per window: loss sum / item count (global)
    items: list[int] = field(default_factory=list)       # per window: item count (global)
    lrs: list[float] = field(default_factory=list)       # learning rate of each step
    grad_norms: list[float] = field(default_factory=list)  # total norm before clipping (when clipping)


def windows(batches: Iterable[Batch], k: int) -> Iterator[list[Batch]]:
    """Group micro-batches into windows of `k`; the last window may be shorter (lesson 2)."""
    k = check_accumulation_steps(k)
    window: list[Batch] = []
    for batch in batches:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []
    if window:
        yield window


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _all_reduce_number(value: float | int, device: torch.device, dtype=torch.float64) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(t)
    return t.item()


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def train_with_accumulation(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[Batch],
                            loss: SampleLoss | TokenLoss, accumulation_steps: int, *,
                            scheduler: Any = None, max_grad_norm: float | None = None,
                            scaler: torch.amp.GradScaler | None = None, autocast_dtype: torch.dtype | None = None,
                            empty_window: str = "error", progress: bool = True,
                            mistakes: Iterable[str] = ()) -> TrainResult:
    """Train over `batches` (micro-batches), one optimizer step per window of K (lesson 2).

    Every detail, each tested:
    - the window's item count (tokens for `TokenLoss`) is counted from the labels before any forward
      pass, summed over the window (and all-reduced across ranks under DDP), and each micro-batch's
      loss sum is divided by it: the gradient equals the whole window's, whatever the padding;
    - a short final window (len(batches) not a multiple of K) is normalised by its own count, and
      stepped;
    - optimizer and scheduler step once per window; a step that GradScaler skips (inf/NaN gradients)
      does not step the scheduler;
    - with a GradScaler: unscale once, after the last micro-batch, then clip (`max_grad_norm`), then
      `scaler.step`, `scaler.update`;
    - gradients are reset with `zero_grad(set_to_none=True)` (memory freed between windows);
    - under DDP, forward and backward of all but the last micro-batch of a window run inside
      `model.no_sync()`: one gradient all-reduce per window; the loss is multiplied by the world size
      because DDP averages gradients over ranks;
    - a tqdm progress bar over optimizer steps (`progress=False` silences it).

    A window with no valid item at all raises ValueError (`empty_window="error"`, the default) or is
    skipped without any step (`empty_window="skip"`, counted in `TrainResult.empty_windows`); its
    loss is never a NaN. `mistakes` names entries of `MISTAKES` to reproduce them (lesson 2 shows
    what each one breaks); leave it empty for correct training.
    """
    from tqdm.auto import tqdm

    k = check_accumulation_steps(accumulation_steps)
    mistakes = frozenset(mistakes)
    unknown = mistakes - MISTAKES.keys()
    if unknown:
        raise ValueError(f"unknown mistakes {sorted(unknown)}: choose from {sorted(MISTAKES)}")
    if empty_window not in ("error", "skip"):
        raise ValueError(f"empty_window must be 'error' or 'skip', got {empty_window!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    ddp = _is_ddp(model)
    world = torch.distributed.get_world_size() if ddp else 1
    device = _model_device(model)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    set_to_none = "zero_grad_to_zero" not in mistakes

    def zero_grad() -> None:
        if "never_zero_grad" not in mistakes:
            optimizer.zero_grad(set_to_none=set_to_none)

    autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    total = math.ceil(len(batches) / k) if hasattr(batches, "__len__") else None
    result = TrainResult()
    model.train()
    zero_grad()

    def clip() -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))

    stepped: list[bool] = []
    hook = optimizer.register_step_post_hook(lambda *args: stepped.append(True))
    with hook, tqdm(total=total, disable=not progress, desc="optimizer steps", unit="step") as bar:
        for window in windows(batches, k):
            result.windows += 1
            counts = [loss.count(mb) for mb in window]
            local_items = sum(counts)
            items = local_items
            if ddp and "count_per_rank" not in mistakes:
                items = int(_all_reduce_number(local_items, device))
            if items == 0:
                if empty_window == "error":
                    raise ValueError(f"window {result.windows} has no valid item (every label is ignore_index): "
                                     "its mean loss is 0/0. Fix the data, or pass empty_window='skip'.")
                result.empty_windows += 1
                bar.update(1)
                continue
            if "mean_per_micro_batch" in mistakes or "divide_by_configured_k" in mistakes:
                divisor = len(window) if "mean_per_micro_batch" in mistakes else k
                scales = micro_batch_losses(loss, "naive", counts, divisor)
            elif "count_per_rank" in mistakes:
                scales = [lambda s, n=max(local_items, 1): s / n for _ in counts]
            else:
                scales = [lambda s: s * world / items for _ in counts]
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # read once per window: no sync per micro-batch
            for i, mb in enumerate(window):
                last = i == len(window) - 1
                quiet = ddp and "sync_every_micro_batch" not in mistakes and (not last or "never_sync" in mistakes)
                with model.no_sync() if quiet else contextlib.nullcontext():
                    with autocast():
                        s = loss.sum(model, mb)
                    scaled = scales[i](s)
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                loss_sum += s.detach().double()
                result.micro_batches += 1
                if not last and "clip_before_last_micro_batch" in mistakes and max_grad_norm is not None:
                    clip()
                if not last and "scheduler_per_micro_batch" in mistakes and scheduler is not None:
                    scheduler.step()
                if not last and "optimizer_step_per_micro_batch" in mistakes:
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    zero_grad()
            if ddp:
                torch.distributed.all_reduce(loss_sum)  # for the reported loss only
            result.losses.append(loss_sum.item() / items)
            result.items.append(items)
            if "no_step_after_short_window" in mistakes and len(window) < k:
                bar.update(1)
                continue
            if max_grad_norm is not None:
                if scaler is not None and "clip_before_unscale" not in mistakes:
                    scaler.unscale_(optimizer)
                result.grad_norms.append(clip())
            result.lrs.append(float(optimizer.param_groups[0]["lr"]))
            stepped.clear()
            if scaler is not None:
                scaler.step(optimizer)  # skips optimizer.step() when the gradients hold inf/NaN
                scaler.update()
            else:
                optimizer.step()
            if not stepped:
                result.skipped_steps += 1
            else:
                result.steps += 1
                if scheduler is not None:
                    scheduler.step()
            zero_grad()
            bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
            bar.update(1)
    return result


def train_whole_windows(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch],
                        loss: SampleLoss | TokenLoss, accumulation_steps: int, *, scheduler: Any = None,
                        max_grad_norm: float | None = None) -> TrainResult:
    """The ground truth accumulation must match: each window concatenated into one batch (lesson 2).

    One forward and backward of the whole window, its loss sum divided by its item count, then clip,
    step and scheduler step. Independent of `train_with_accumulation` on purpose: the checks compare
    the two.
    """
    result = TrainResult()
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for window in windows(batches, accumulation_steps):
        whole = concat_batches(window)
        n = loss.count(whole)
        if n == 0:
            raise ValueError("a window has no valid item")
        optimizer.zero_grad(set_to_none=True)
        s = loss.sum(model, whole)
        (s / n).backward()
        if max_grad_norm is not None:
            result.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        result.lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        result.windows += 1
        result.steps += 1
        result.micro_batches += len(window)
        result.losses.append(float(s.detach()) / n)
        result.items.append(n)
    optimizer.zero_grad(set_to_none=True)
    return result


def max_weight_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest |difference| between same-named parameters of two models, relative to the largest |weight|."""
    b_params = dict(_unwrap(b).named_parameters())
    worst = 0.0
    for name, p in _unwrap(a).named_parameters():
        q = b_params[name]
        scale = max(_max_abs(q), 1e-12)
        worst = max(worst, _max_abs(p.detach().double() - q.detach().double().to(p.device)) / scale)
    return worst


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if _is_ddp(model) else model


def demonstrate_mistakes(mistakes: Iterable[str] | None = None, seed: int = 0) -> list[tuple[str, float]]:
    """Train with each single-process mistake and report how far the weights end from the truth (lesson 2).

    Same tiny token model, padded data (10 micro-batches, K=4: a short final window), SGD with
    momentum, a decaying schedule and clipping, against `train_whole_windows`; `clip_before_unscale`
    also gets a GradScaler (exact in fp32 with a power-of-two scale). Returns (name, max relative
    weight difference); "none" (the reference loop) first.
    The DDP mistakes need two processes: see `ddp_accumulation_demo`.
    """
    names = ["none"] + list(mistakes if mistakes is not None else
                            [m for m in MISTAKES if m not in ("sync_every_micro_batch", "never_sync", "count_per_rank")])
    batches = padded_token_batches(10, batch_size=3, seed=seed)
    loss = TokenLoss()
    out = []
    truth = TinyTokenLM(seed=seed)
    opt, sched = _sgd_and_schedule(truth)
    train_whole_windows(truth, opt, batches, loss, 4, scheduler=sched, max_grad_norm=0.5)
    for name in names:
        model = TinyTokenLM(seed=seed)
        opt, sched = _sgd_and_schedule(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if name == "clip_before_unscale" else None
        with warnings.catch_warnings():  # scheduler_per_micro_batch makes torch warn about the order: expected
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            train_with_accumulation(model, opt, batches, loss, 4, scheduler=sched, max_grad_norm=0.5, scaler=scaler,
                                    progress=False, mistakes=() if name == "none" else (name,))
        out.append((name, max_weight_difference(model, truth)))
    return out


def _sgd_and_schedule(model: nn.Module, lr: float = 0.5):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    return opt, sched


# --------------------------------------------------------------------------------------------------
# Cross-check 1: Hugging Face Trainer
# --------------------------------------------------------------------------------------------------

@dataclass
class TrainerCrossCheck:
    """Final weights of the reference loop, the naive loop and HF Trainer from the same start (lesson 2)."""

    reference_vs_trainer: float   # max relative weight difference
    naive_vs_trainer: float
    reference_vs_initial: float   # how far training moved the weights (the scale of the above)
    micro_batches: int
    accumulation_steps: int
    optimizer_steps: int
    transformers_version: str

    def __str__(self) -> str:
        return (f"{self.micro_batches} micro-batches, gradient_accumulation_steps={self.accumulation_steps}, "
                f"{self.optimizer_steps} optimizer steps; max relative weight difference:\n"
                f"  reference loop vs Trainer: {self.reference_vs_trainer:.1e}\n"
                f"  naive per-micro-batch mean vs Trainer: {self.naive_vs_trainer:.1e}\n"
                f"  (training moved the weights by {self.reference_vs_initial:.1e})")


def trainer_cross_check(n_sequences: int = 22, micro_batch_size: int = 2, accumulation_steps: int = 4,
                        lr: float = 1e-2, max_grad_norm: float = 1.0, seed: int = 0) -> TrainerCrossCheck:
    """Train a tiny Llama (random weights) with HF Trainer and with our loop; compare (lesson 2).

    The data are generated variable-length sequences, right-padded per micro-batch by the same
    collator for both. Both runs start from copies of one model, use the same AdamW and linear decay
    (handed to the Trainer through `optimizers=`), the same clipping, a sequential order and
    `gradient_accumulation_steps=accumulation_steps`; `n_sequences / micro_batch_size` not a multiple
    of K exercises the short final window. Nothing is downloaded or saved.
    """
    import transformers
    from transformers import LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

    from torch.utils.data import DataLoader, SequentialSampler

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    examples = padded_token_examples(n_sequences, vocab_size=64, max_len=16, min_len=2, seed=seed)
    torch.manual_seed(seed)
    initial = LlamaForCausalLM(tiny_causal_lm_config())
    micro = math.ceil(n_sequences / micro_batch_size)
    steps = math.ceil(micro / accumulation_steps)

    def fresh():
        model = copy.deepcopy(initial)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
        return model, opt, sched

    hf_model, hf_opt, hf_sched = fresh()
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=micro_batch_size,
                                 gradient_accumulation_steps=accumulation_steps, num_train_epochs=1,
                                 max_grad_norm=max_grad_norm, report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=seed,
                                 dataloader_num_workers=0, dataloader_pin_memory=False)
        trainer = SequentialTrainer(model=hf_model, args=args, train_dataset=examples, data_collator=collate_padded,
                                    optimizers=(hf_opt, hf_sched))
        trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print the final metrics
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    batches = list(DataLoader(examples, batch_size=micro_batch_size, shuffle=False, collate_fn=collate_padded))
    results = {}
    for name, mistakes in (("reference", ()), ("naive", ("mean_per_micro_batch",))):
        model, opt, sched = fresh()
        train_with_accumulation(model, opt, batches, TokenLoss(), accumulation_steps, scheduler=sched,
                                max_grad_norm=max_grad_norm, progress=False, mistakes=mistakes)
        results[name] = model
    return TrainerCrossCheck(
        reference_vs_trainer=max_weight_difference(results["reference"], trainer.model),
        naive_vs_trainer=max_weight_difference(results["naive"], trainer.model),
        reference_vs_initial=max_weight_difference(results["reference"], initial),
        micro_batches=micro, accumulation_steps=accumulation_steps, optimizer_steps=trainer.state.global_step,
        transformers_version=transformers.__version__)


# --------------------------------------------------------------------------------------------------
# Cross-check 2: DDP with no_sync, two processes on CPU (gloo)
# --------------------------------------------------------------------------------------------------

@dataclass
class DDPReport:
    """A DDP run of the reference loop against one process (lesson 2, "no_sync placement")."""

    mistakes: tuple[str, ...]
    world_size: int
    micro_batches: int          # per rank
    windows: int
    buckets: int                # gradient buckets per all-reduce round (1 for the tiny model)
    allreduces_per_window: list[int]   # gradient all-reduce rounds in each window (rank 0)
    max_diff_vs_single: float   # max relative weight difference, any rank vs the one-process run
    max_diff_between_ranks: float

    def __str__(self) -> str:
        label = ", ".join(self.mistakes) or "reference loop"
        return (f"{label}: all-reduces per window {self.allreduces_per_window}, "
                f"vs one process {self.max_diff_vs_single:.1e}, between ranks {self.max_diff_between_ranks:.1e}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_data(world_size: int, n_micro: int, rows_per_rank: int, seed: int):
    """Full micro-batches and each rank's shard; rank r holds rows r::world_size of every micro-batch."""
    full = padded_token_batches(n_micro, batch_size=rows_per_rank * world_size, seed=seed)
    shards = [[{key: value[r::world_size] for key, value in mb.items()} for mb in full] for r in range(world_size)]
    return full, shards


def _ddp_train_kwargs(model: nn.Module):
    opt, sched = _sgd_and_schedule(model, lr=0.3)
    return dict(optimizer=opt, scheduler=sched, max_grad_norm=None)


def _ddp_worker(rank: int, world_size: int, port: int, out_dir: str, variants, n_micro: int, k: int,
                rows_per_rank: int, seed: int, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        _, shards = _ddp_data(world_size, n_micro, rows_per_rank, seed)
        results = {}
        for mistakes in variants:
            model = TinyTokenLM(seed=seed)
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            calls: list[int] = []

            def counting_hook(state, bucket):
                calls.append(bucket.index())
                group = dist.group.WORLD
                fut = dist.all_reduce(bucket.buffer() / world_size, group=group, async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            ddp.register_comm_hook(None, counting_hook)
            kwargs = _ddp_train_kwargs(ddp)
            per_window: list[int] = []
            marks = [0]

            def after_step(optimizer, args, kw):
                per_window.append(len(calls) - marks[0])
                marks[0] = len(calls)

            kwargs["optimizer"].register_step_post_hook(after_step)
            train_with_accumulation(ddp, batches=shards[rank], loss=TokenLoss(), accumulation_steps=k,
                                    progress=False, mistakes=mistakes, **kwargs)
            buckets = max(calls) + 1 if calls else 1
            results[tuple(mistakes)] = {
                "state": {n: p.detach().clone() for n, p in model.named_parameters()},
                "rounds_per_window": [c // buckets for c in per_window],
                "buckets": buckets,
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def ddp_accumulation_demo(variants: Sequence[Sequence[str]] = ((),), world_size: int = 2, n_micro: int = 6,
                          accumulation_steps: int = 4, rows_per_rank: int = 2, seed: int = 0,
                          timeout_s: float = 120.0) -> list[DDPReport]:
    """Run the reference loop under DDP in `world_size` CPU processes (gloo) and check it (lesson 2).

    Each variant (a tuple of `MISTAKES` names; `()` is the correct loop) trains a tiny token model on
    each rank's shard of padded micro-batches (6 micro-batches, K=4: a full and a short window) and
    is compared with one process training on the full micro-batches. A DDP comm hook counts the
    gradient all-reduces of each window. Processes start with `spawn` on 127.0.0.1 and a free port;
    they are killed and an error is raised if they do not finish within `timeout_s`.
    """
    import torch.multiprocessing as mp

    variants = [tuple(v) for v in variants]
    for v in variants:
        unknown = set(v) - MISTAKES.keys()
        if unknown:
            raise ValueError(f"unknown mistakes {sorted(unknown)}")
    full, _ = _ddp_data(world_size, n_micro, rows_per_rank, seed)
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world_size, _free_port(), out_dir, variants, n_micro, accumulation_steps, rows_per_rank, seed,
                timeout_s)
        context = mp.start_processes(_ddp_worker, args=args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size} DDP processes did not finish within {timeout_s:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
    reports = []
    for v in variants:
        single = TinyTokenLM(seed=seed)
        kwargs = _ddp_train_kwargs(single)
        train_with_accumulation(single, batches=full, loss=TokenLoss(), accumulation_steps=accumulation_steps,
                                progress=False, **kwargs)
        states = [r[v]["state"] for r in per_rank]
        ref = dict(single.named_parameters())
        vs_single = max(_max_abs(s[n].double() - ref[n].detach().double()) / max(_max_abs(ref[n]), 1e-12)
                        for s in states for n in s)
        between = max(_max_abs(s[n].double() - states[0][n].double()) / max(_max_abs(states[0][n]), 1e-12)
                      for s in states[1:] for n in s) if world_size > 1 else 0.0
        reports.append(DDPReport(mistakes=v, world_size=world_size, micro_batches=n_micro,
                                 windows=math.ceil(n_micro / accumulation_steps), buckets=per_rank[0][v]["buckets"],
                                 allreduces_per_window=per_rank[0][v]["rounds_per_window"],
                                 max_diff_vs_single=vs_single, max_diff_between_ranks=between))
    return reports


# --------------------------------------------------------------------------------------------------
# Cost: time and memory vs micro-batch size at a fixed effective batch
# --------------------------------------------------------------------------------------------------

@dataclass
class CostRow:
    """One micro-batch size at a fixed effective batch (lesson 2, "what accumulation costs")."""

    micro_batch: int
    k: int
    flops: int                 # forward + backward FLOPs of one optimizer step (all K micro-batches)
    ms_per_step: float         # best time of one optimizer step (K forward/backward + step) over the repeats
    peak_bytes: int            # peak live bytes during one optimizer step (absolute)
    parameters: int
    gradients: int
    optimizer_state: int
    saved_per_micro_batch: int  # bytes autograd saves for backward in one micro-batch's forward
    inputs: int = 0            # bytes of the window's data (all K micro-batches, inputs and targets)

    @property
    def fixed_bytes(self) -> int:
        """Parameters, gradients and optimizer state: the part accumulation cannot shrink."""
        return self.parameters + self.gradients + self.optimizer_state


def cost_model(width: int = 512, depth: int = 4, seed: int = 0) -> nn.Sequential:
    """The MLP the cost measurement trains: `depth` Linear(width, width) + LayerNorm + GELU blocks."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def measure_accumulation_cost(effective_batch: int = 64, micro_batches: Sequence[int] = (64, 16, 4, 1),
                              width: int = 256, depth: int = 4, seq_len: int = 32, repeats: int = 3,
                              device: torch.device | str | None = None, seed: int = 0) -> list[CostRow]:
    """Time, peak memory and FLOPs of one optimizer step vs micro-batch size (lesson 2).

    The effective batch is fixed; each micro-batch size b runs K = effective_batch / b forward and
    backward passes and one AdamW step on `cost_model(width, depth)`, each sample a sequence of
    `seq_len` positions (so that activations weigh as they do in a language model). FLOPs are counted
    by `torch.utils.flop_counter` (equal for every b). Time: after one warm-up step each, the sizes
    are timed in turn, `repeats` rounds, and each keeps its best step (a burst of load from other
    processes then hits every size alike, and the minimum is the least disturbed). The peak is
    measured in a separate step, by `course_lib.measure.LiveStorageTracker` on CPU and by the CUDA
    allocator's peak statistics on a GPU.
    """
    from torch.utils.flop_counter import FlopCounterMode


    device = torch.device(device) if device is not None else torch.device("cpu")
    for b in micro_batches:
        if b < 1 or effective_batch % b:
            raise ValueError(f"micro-batch {b} does not divide the effective batch {effective_batch}")
    gen = torch.Generator().manual_seed(seed)
    x_all = torch.randn(effective_batch, seq_len, width, generator=gen).to(device)
    y_all = torch.randn(effective_batch, seq_len, width, generator=gen).to(device)
    denominator = effective_batch * seq_len * width

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    setups = []
    for b in micro_batches:
        model = cost_model(width, depth, seed).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        micro = [(x_all[i:i + b].clone(), y_all[i:i + b].clone()) for i in range(0, effective_batch, b)]

        def forward_backward(model=model, micro=micro) -> None:
            for x, y in micro:
                (F.mse_loss(model(x), y, reduction="sum") / denominator).backward()

        def step(forward_backward=forward_backward, opt=opt) -> None:
            forward_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up; allocates the optimizer state
        setups.append((b, model, opt, micro, forward_backward, step))
    times: dict[int, list[float]] = {b: [] for b in micro_batches}
    for _ in range(repeats):
        for b, *_, step in setups:
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[b].append((time.perf_counter() - start) * 1e3)
    rows = []
    for b, model, opt, micro, forward_backward, step in setups:
        with FlopCounterMode(display=False) as counter:
            forward_backward()
        opt.zero_grad(set_to_none=True)
        params = list(model.parameters())
        data = [t for pair in micro for t in pair]
        peak = peak_bytes(step, params + optimizer_state_tensors(opt) + data, device)
        with SavedTensorRecorder(params) as saved_by_one_micro_batch:
            F.mse_loss(model(micro[0][0]), micro[0][1])
        rows.append(CostRow(micro_batch=b, k=len(micro), flops=int(counter.get_total_flops()),
                            ms_per_step=min(times[b]), peak_bytes=int(peak), parameters=storage_bytes(params),
                            gradients=storage_bytes(params),  # one gradient per parameter, same shape and dtype
                            optimizer_state=storage_bytes(optimizer_state_tensors(opt)),
                            saved_per_micro_batch=saved_by_one_micro_batch.bytes, inputs=storage_bytes(data)))
    return rows


def format_cost_table(rows: Sequence[CostRow]) -> str:
    """The cost rows as a text table, with time and peak memory relative to the largest micro-batch."""

    base = max(rows, key=lambda r: r.micro_batch)
    lines = [f"{'micro':>5} {'K':>4} {'GFLOP/step':>10} {'ms/step':>9} {'x time':>7} {'peak':>11} {'x peak':>7} "
             f"{'saved/micro':>11} {'params+grads+Adam':>18}"]
    for r in rows:
        lines.append(f"{r.micro_batch:>5} {r.k:>4} {r.flops / 1e9:>10.3f} {r.ms_per_step:>9.1f} "
                     f"{r.ms_per_step / base.ms_per_step:>7.2f} {format_bytes(r.peak_bytes):>11} "
                     f"{r.peak_bytes / base.peak_bytes:>7.2f} {format_bytes(r.saved_per_micro_batch):>11} "
                     f"{format_bytes(r.fixed_bytes):>18}")
    return "\n".join(lines)
