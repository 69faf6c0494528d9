"""Mixture-of-experts models in transformers 5 under LoRA and QLoRA: what the planner can plan (lesson 1,
"the planner").

transformers 5 (models/mixtral, qwen2_moe, qwen3_moe) stores each MoE layer's experts as two 3-D
`nn.Parameter`s, `gate_up_proj` (experts, 2 x intermediate, hidden) and `down_proj` (experts, hidden,
intermediate), run by `grouped_mm` (integrations/moe.py, the default `experts_implementation`). So:

- bitsandbytes' 4-bit quantizer (integrations/bitsandbytes.py `replace_with_bnb_linear`) replaces
  `nn.Linear` modules only: the experts, most of the model, stay 16-bit (states.py counts them so:
  only linear layers are packed);
- peft's `prepare_model_for_kbit_training` upcasts every 16-bit parameter that is no `Params4bit` to
  fp32 (peft/utils/other.py): the experts too, and `grouped_mm` then runs in fp32;
- peft 0.21's "all-linear" on Mixtral and Qwen2-MoE also adapts the experts, through
  `target_parameters` (utils/transformers_weight_conversion.py `_convert_peft_config_moe`): a
  `lora.ParamWrapper` per 3-D parameter, whose forward adds the whole delta weight to the experts.
  The planner's states do not model those adapters: it refuses them in one line. LoRA on the attention
  projections (explicit `lora_targets`) leaves the experts frozen and is planned.
"""

from __future__ import annotations

import torch

from course_lib.measure import format_bytes
from course_lib.models import ModelSpec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup, itemsize


def fused_experts(spec: ModelSpec, setup: Setup) -> tuple[int, int, str]:
    """(elements, stored bytes, dtype's name) of the model's fused 3-D experts as `setup` stores them: in
    the weights' dtype, fp32 after prepare_model_for_kbit_training; (0, 0, ...) for a model without them."""
    experts = sum(info.numel for info in spec.params if len(info.shape) == 3)
    size = 4 if setup.prepare_kbit else itemsize(setup.weight_dtype)
    dtype = "fp32 after prepare_model_for_kbit_training" if setup.prepare_kbit else str(setup.weight_dtype)[6:]
    return experts, experts * size, dtype


def unquantized_experts_note(spec: ModelSpec, setup: Setup) -> str | None:
    """The warning a 4-bit plan of a model with fused experts carries: how much bitsandbytes leaves
    unquantized, and why (bitsandbytes issue 1849); None without a 4-bit base or fused experts."""
    experts, stored, dtype = fused_experts(spec, setup)
    if setup.quant == "none" or not experts:
        return None
    return (
        f"warning: --quant {setup.quant} leaves {format_bytes(stored)} of {spec.name}'s experts in {dtype} "
        f"({experts / spec.n_params:.0%} of the parameters): transformers 5 stores them as fused 3-D "
        "parameters, and bitsandbytes' 4-bit quantizer replaces nn.Linear only (transformers' "
        "integrations/bitsandbytes.py replace_with_bnb_linear; "
        "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1849); the per-expert nn.Linear "
        "layout of transformers 4, whose experts QLoRA does quantize, is not planned"
    )


def refuse_lora_on_experts(model: torch.nn.Module, spec: ModelSpec, setup: Setup) -> None:
    """PlanError, one line, when peft adapted a 3-D experts parameter of the (meta) peft `model`."""
    if not any(type(module).__name__ == "ParamWrapper" for module in model.modules()):
        return
    experts, stored, dtype = fused_experts(spec, setup)
    raise PlanError(
        f"LoRA on {spec.name}'s experts is not modelled: transformers 5 stores them as 3-D parameters "
        f"({experts / spec.n_params:.0%} of the parameters, {stored / 2**30:.1f} GiB in {dtype}), "
        "which bitsandbytes' 4-bit quantizer leaves unquantized (it replaces nn.Linear only) and peft's "
        f"{setup.lora_targets!r} adapts through target_parameters; plan LoRA on the attention projections "
        "(lora_targets=('q_proj', 'k_proj', 'v_proj', 'o_proj') in course_lib.planner.plan)"
    )


class _MetaGroupedMM(torch.autograd.Function):
    """torch's grouped_mm on meta tensors of a dtype its meta kernel refuses (it takes bf16 only; the CPU
    kernel takes fp32 too: the experts after prepare_model_for_kbit_training). What the native op
    allocates: one (tokens, out) output; its backward node (GroupedMmBackward0) keeps the offsets, the
    weights when the input needs a gradient and the input when the weights need one (measured with
    saved_tensors_hooks on the CPU kernel), and makes only the gradients asked for."""

    @staticmethod
    def forward(ctx, mat_a, mat_b, offs):
        ctx.save_for_backward(
            mat_a if ctx.needs_input_grad[1] else None, mat_b if ctx.needs_input_grad[0] else None, offs
        )
        ctx.shapes = (mat_a.shape, mat_b.shape)
        return mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))

    @staticmethod
    def backward(ctx, grad):
        a_shape, b_shape = ctx.shapes
        return (
            grad.new_empty(a_shape) if ctx.needs_input_grad[0] else None,
            grad.new_empty(b_shape) if ctx.needs_input_grad[1] else None,
            None,
        )


def grouped_mm_on_meta(original):
    """`torch.nn.functional.grouped_mm` as the planner's meta-device trace runs it (transformers 5's MoE
    experts, `integrations/moe.py`): the native op, or `_MetaGroupedMM` for meta tensors not in bf16."""

    def grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
        if mat_a.device.type == "meta" and mat_a.dtype != torch.bfloat16 and bias is None and out_dtype is None:
            return _MetaGroupedMM.apply(mat_a, mat_b, offs)
        return original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    return grouped_mm
