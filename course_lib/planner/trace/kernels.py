"""The planner's meta-device kernels (lesson 1, "the planner"): attention, dropout and MoE experts on
meta tensors allocate what the real kernels on the target device would."""

from __future__ import annotations

import contextlib

import torch

from course_lib.planner.trace.autocast import MetaAutocast
from course_lib.planner.trace.moe import grouped_mm_on_meta


@contextlib.contextmanager
def kernels_as_on(target: str, autocast: MetaAutocast | None = None):
    """Make attention and dropout on meta tensors allocate what the real kernels would.

    `F.scaled_dot_product_attention` on meta would take the math path (an s x s score matrix). On the
    CPU, torch picks its own kernel (asked here with small CPU tensors of the same kind); on CUDA the
    fused kernels (flash, memory-efficient) keep the output and a float32 log-sum-exp, like the CPU
    flash kernel used here. A training `F.dropout` on meta, as on the CPU, multiplies by a noise tensor
    of the input's dtype, which backward keeps; on CUDA it is one fused kernel, `native_dropout`, that
    keeps a 1-byte mask (aten/src/ATen/native/Dropout.cpp, `dropout`): asked for here. Under `autocast`
    (the patched SDPA is no torch function its mode sees) the inputs are cast as autocast casts them.
    """
    original = torch.nn.functional.scaled_dot_product_attention
    original_dropout = torch.nn.functional.dropout
    original_grouped_mm = torch.nn.functional.grouped_mm
    grouped_mm = grouped_mm_on_meta(original_grouped_mm)  # MoE experts in fp32 (prepare_kbit) or fp16

    def dropout(input, p=0.5, training=True, inplace=False):
        if target == "cuda" and input.device.type == "meta" and training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original_dropout(input, p, training, inplace)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast is not None:
            (query, key, value, attn_mask), _ = autocast.cast(
                "scaled_dot_product_attention", (query, key, value, attn_mask), {}
            )
        if query.device.type != "meta":
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if target == "cuda" or _cpu_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) == 1:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    # transformers looks for packed sequences in the position ids, a data-dependent test the meta
    # device cannot answer; a plain batch (positions 0 .. s-1 in every row) has none.
    from transformers import masking_utils

    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    torch.nn.functional.dropout = dropout
    torch.nn.functional.grouped_mm = grouped_mm
    if find_packed is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        torch.nn.functional.dropout = original_dropout
        torch.nn.functional.grouped_mm = original_grouped_mm
        if find_packed is not None:
            masking_utils.find_packed_sequence_indices = find_packed


def _cpu_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> int:
    """Which kernel torch's CPU SDPA would pick (0 math, 1 flash) for tensors of this kind."""

    def small(t):
        shape = list(t.shape)
        shape[0] = 1
        if len(shape) >= 2:
            shape[-2] = min(shape[-2], 8)
        return torch.zeros(shape, dtype=t.dtype, requires_grad=t.requires_grad)

    mask = None
    if attn_mask is not None:
        shape = [1] * (attn_mask.dim() - 2) + [min(query.shape[-2], 8), min(key.shape[-2], 8)]
        mask = torch.zeros(shape, dtype=attn_mask.dtype)
    with torch.no_grad():
        return int(
            torch._fused_sdp_choice(
                small(query), small(key), small(value), mask, dropout_p, is_causal, enable_gqa=enable_gqa
            )
        )
