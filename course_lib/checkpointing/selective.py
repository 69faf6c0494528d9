"""Selective checkpointing policies: which op outputs a checkpointed segment keeps (lesson 3,
"selective checkpointing").

torch's policy API (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, non-reentrant only)
asks a policy, op by op, whether to keep the op's output (`MUST_SAVE`) or recompute it in backward
(`PREFER_RECOMPUTE`). Korthikanti et al. 2022 (section 5) recompute the *attention core* (the scores
Q K^T, softmax, dropout, attention over V: the 5as/h term) and keep the linear layers' outputs. torch
keeps a saved op's output whether or not backward needs it, so the closest policy keeps only the
linear layers' outputs (mm, addmm) and recomputes everything else: the attention core and the cheap
pointwise ops. "save-matmuls" keeps every matmul, the attention ones (bmm: the s x s scores under
eager attention) included. "save-all" keeps every op's output: it recomputes nothing and measures what
the policy machinery itself costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from course_lib.errors import UserError

LINEAR_OPS = tuple(getattr(torch.ops.aten, name) for name in ("mm", "addmm") if hasattr(torch.ops.aten, name))
ATTENTION_OPS = tuple(
    getattr(torch.ops.aten, name)
    for name in (
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)
MATMUL_OPS = LINEAR_OPS + ATTENTION_OPS


def _packet(op):
    return getattr(op, "overloadpacket", op)


def korthikanti_policy(ctx, op, *args, **kwargs):
    """Keep the linear layers' outputs (mm, addmm), recompute the rest, the attention core included
    (Korthikanti et al. 2022, section 5; lesson 3, "selective checkpointing")."""
    return CheckpointPolicy.MUST_SAVE if _packet(op) in LINEAR_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_policy(ctx, op, *args, **kwargs):
    """Keep every matmul and attention kernel's output, recompute the pointwise ops: the seed's
    "selective" policy (lesson 3, "selective checkpointing")."""
    return CheckpointPolicy.MUST_SAVE if _packet(op) in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_everything_policy(ctx, op, *args, **kwargs):
    """Keep every op's output: the control that measures the policy machinery's own cost (lesson 3)."""
    return CheckpointPolicy.MUST_SAVE


POLICIES = {"korthikanti": korthikanti_policy, "save-matmuls": save_matmuls_policy, "save-all": save_everything_policy}


def policy_name(policy) -> str:
    """A short name for a policy: "full", a POLICIES key, or the function's name."""
    if policy is None or isinstance(policy, str):
        return policy or "full"
    for name, function in POLICIES.items():
        if function is policy:
            return name
    return getattr(policy, "__name__", "custom")


def context_fn_for(policy) -> Callable | None:
    """The `context_fn` for torch's non-reentrant checkpoint: None for full checkpointing (lesson 3)."""
    if policy is None or policy == "full":
        return None

    if isinstance(policy, str):
        if policy not in POLICIES:
            raise UserError(
                f"unknown policy {policy!r}: use 'full', one of {', '.join(POLICIES)}, or a policy "
                "function (ctx, op, *args, **kwargs) -> CheckpointPolicy"
            )
        policy = POLICIES[policy]
    elif not callable(policy):
        raise UserError(
            f"a policy is a name or a function (ctx, op, *args, **kwargs) -> CheckpointPolicy, got {policy!r}"
        )
    return functools.partial(create_selective_checkpoint_contexts, policy)
