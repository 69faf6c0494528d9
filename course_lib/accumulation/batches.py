"""Batches for lesson 2: split into micro-batches, concatenate, cast, generate, collate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from course_lib import validate
from course_lib.accumulation.losses import IGNORE_INDEX, Batch
from course_lib.errors import UserError, UserTypeError
from course_lib.validate import Count, Device, checked


@checked
def batch_size(batch: Batch) -> int:
    """Number of rows (samples or sequences) of a batch: the first dimension, the same in each tensor."""
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    if not tensors or any(t.dim() == 0 for t in tensors):
        raise UserError("a batch is a tuple (inputs, targets) or a dict of tensors, each with a row per sample")
    rows = {int(t.shape[0]) for t in tensors}
    if len(rows) > 1:
        raise UserError(f"the batch's tensors have different numbers of rows {sorted(rows)}: give each the same")
    return rows.pop()


def check_accumulation_steps(k: Any) -> int:
    """Validate an accumulation step count: a positive int, else a clear error (lesson 2)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise UserTypeError(f"accumulation steps must be an int, got {type(k).__name__} {k!r}")
    if k <= 0:
        raise UserError(f"accumulation steps must be >= 1, got {k}: K micro-batches per optimizer step")
    return k


@checked
def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split a batch into `k` micro-batches along the first dimension (lesson 2).

    Sizes differ by at most one row (`torch.tensor_split`). `k` larger than the batch would leave
    empty micro-batches: that is an error, not a silent no-op.
    """
    k = check_accumulation_steps(k)
    n = batch_size(batch)
    if k > n:
        raise UserError(f"cannot split a batch of {n} rows into {k} micro-batches: K must be <= the batch size")
    if isinstance(batch, dict):
        parts = {key: torch.tensor_split(value, k) for key, value in batch.items()}
        return [{key: parts[key][i] for key in batch} for i in range(k)]
    columns = [torch.tensor_split(t, k) for t in batch]
    return [tuple(column[i] for column in columns) for i in range(k)]


@checked
def concat_batches(batches: Sequence[Batch], pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX) -> Batch:
    """Concatenate micro-batches into one batch; token batches are right-padded to a common length."""
    if not batches:
        raise UserError("nothing to concatenate")
    if isinstance(batches[0], dict):
        length = max(b["input_ids"].shape[1] for b in batches)
        fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": ignore_index}
        out = {}
        for key in batches[0]:
            parts = [F.pad(b[key], (0, length - b[key].shape[1]), value=fill.get(key, 0)) for b in batches]
            out[key] = torch.cat(parts)
        return out
    return tuple(torch.cat(column) for column in zip(*batches))


@checked
def cast_batch(batch: Batch, dtype: torch.dtype | None = None, device: Device | None = None) -> Batch:
    """Move a batch to `device` and cast its floating tensors to `dtype` (integer tensors keep theirs)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    if isinstance(batch, dict):
        return {key: move(value) for key, value in batch.items()}
    return tuple(move(t) for t in batch)


@checked
def padded_token_examples(
    n: Count, vocab_size: Count = 32, max_len: Count = 12, min_len: Count = 2, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """`n` random token sequences of random lengths in [min_len, max_len] (lesson 2, generated data).

    Each example is a dict with `input_ids` and `labels` (a copy: the model learns to predict the
    next token). Token 0 is reserved for padding and never drawn.
    """
    if not 1 <= min_len <= max_len:
        raise UserError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    examples = []
    for length in lengths.tolist():
        ids = torch.randint(1, vocab_size, (length,), generator=gen)
        examples.append({"input_ids": ids, "labels": ids.clone()})
    return examples


def collate_padded(
    examples: Sequence[dict[str, Any]], pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> dict[str, torch.Tensor]:
    """Right-pad variable-length examples to the longest one: input_ids, attention_mask, labels.

    Padding positions get `pad_token_id`, attention 0 and label `ignore_index`, so that they count
    neither in the loss nor in the item count.
    """
    examples = validate.non_empty("examples", examples, "examples (dicts with input_ids and, optionally, labels)")
    for index, example in enumerate(examples):
        validate.instance(f"examples[{index}]", example, dict, "a dict with input_ids (and labels)")
        if "input_ids" not in example:
            raise UserError(f"examples[{index}] has no input_ids: give each example its token ids")
        ids = validate.whole_numbers(f"examples[{index}]['input_ids']", example["input_ids"], what="token ids")
        if "labels" in example:  # one label a token, never broadcast from a shorter list
            name, what = f"examples[{index}]['labels']", "labels (one per token id)"
            validate.whole_numbers(name, example["labels"], length=len(ids), what=what, minimum=None)
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


@checked
def padded_token_batches(
    n_batches: Count,
    batch_size: Count = 4,
    vocab_size: Count = 32,
    max_len: Count = 12,
    min_len: Count = 2,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """`n_batches` padded token micro-batches of `batch_size` random-length sequences (lesson 2)."""
    n_batches, batch_size, vocab_size, max_len, min_len = (
        validate.positive_int(name, value)
        for name, value in (
            ("n_batches", n_batches),
            ("batch_size", batch_size),
            ("vocab_size", vocab_size),
            ("max_len", max_len),
            ("min_len", min_len),
        )
    )
    examples = padded_token_examples(n_batches * batch_size, vocab_size, max_len, min_len, seed)
    return [collate_padded(examples[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)]


@checked
def regression_batches(
    n_batches: Count, batch_size: Count = 4, in_features: Count = 8, out_features: Count = 4, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` random `(inputs, targets)` micro-batches for a per-sample loss (lesson 2)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, in_features, generator=gen), torch.randn(batch_size, out_features, generator=gen))
        for _ in range(n_batches)
    ]
