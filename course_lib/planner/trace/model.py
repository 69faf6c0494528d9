"""The model the planner traces (lesson 1, "the planner"): the Hugging Face implementation built from its config
on the meta device, with peft's adapters as the setup asks, and the key of what its trace depends on."""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings

import torch

from course_lib.layers import find_layer_stack
from course_lib.models import ModelSpec, build_model, supported_attention, transformers_config
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup
from course_lib.planner.trace.moe import refuse_lora_on_experts


def trace_key(spec: ModelSpec, setup: Setup, target: str) -> tuple:
    """What the trace depends on: the dtypes of the precision, not its name (bf16, mixed-bf16 and
    mixed-bf16-fp32grads trace the same step), save under lesson 7's step in backward, whose temporaries
    follow the master-copy recipe."""
    dtypes = setup.precision if setup.optimizer_in_backward else (str(setup.weight_dtype), str(setup.autocast_dtype))
    return (
        spec.config.to_json_string(use_diff=False),
        dtypes,
        setup.lora_rank,
        str(setup.lora_targets),
        float(setup.lora_dropout),
        setup.autocast_adapter_dtype,
        setup.quant != "none",
        setup.prepare_kbit,
        setup.batch,
        setup.seq,
        setup.attention,
        target,
        setup.loop != "trainer",
        setup.legacy_causal_lm_loss,
        setup.chunked_loss,
        setup.offload_activations,
        (setup.optimizer, setup.adam_state) if setup.optimizer_in_backward else None,
    )


@contextlib.contextmanager
def bitsandbytes_unseen():
    """bitsandbytes unseen by peft while peft is imported and builds a meta model's adapters, where nothing
    has imported bitsandbytes yet: peft 0.21 imports it at its own import (peft/helpers.py:27) and when it
    picks a LoRA layer (tuners/lora/model.py:525-533, through import_utils.is_bnb_4bit_available), and
    importing bitsandbytes imports torch._inductor, about a second of a cold `course-lib plan`. A meta
    trace runs no bitsandbytes layer (a frozen 4-bit layer is traced as a 16-bit one), so peft's answer
    "no bitsandbytes" changes nothing here; its cached answers are cleared after, for a real QLoRA later in
    the same process (`peft.helpers`' condition-number helper keeps seeing none)."""
    if "bitsandbytes" in sys.modules:  # imported already, or unseen by an enclosing call
        yield
        return
    sys.modules["bitsandbytes"] = None  # find_spec answers None and `import bitsandbytes` ImportError
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]
        answers = sys.modules.get("peft.import_utils")
        if answers is not None:
            answers.is_bnb_available.cache_clear()
            answers.is_bnb_4bit_available.cache_clear()


def build_traced_model(spec: ModelSpec, setup: Setup) -> torch.nn.Module:
    """The model of `spec` on the meta device in the setup's dtypes, with peft's adapters as it asks."""
    config = copy.deepcopy(transformers_config(spec.config))
    config.use_cache = False
    dtype = setup.weight_dtype
    model = build_model(config, "meta", dtype=dtype, attn_implementation=supported_attention(config, setup.attention))
    if setup.prepare_kbit:  # peft's prepare_model_for_kbit_training: non-quantized parameters to fp32
        for module in model.modules():
            if not (isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings()):
                for param in module.parameters(recurse=False):
                    param.data = param.data.float()
    model.train()
    if setup.lora_rank:
        targets = setup.lora_targets if setup.lora_targets == "all-linear" else list(setup.lora_targets)
        with bitsandbytes_unseen():
            from peft import LoraConfig, get_peft_model  # off the import path: peft imports transformers

            with warnings.catch_warnings(), torch.device("meta"):  # adapters too: peft builds them on the CPU
                warnings.simplefilter("ignore")
                model = get_peft_model(
                    model,
                    LoraConfig(
                        r=setup.lora_rank,
                        lora_alpha=2 * setup.lora_rank,
                        target_modules=targets,
                        lora_dropout=setup.lora_dropout,
                        init_lora_weights=False,
                    ),  # values: none on meta
                    autocast_adapter_dtype=setup.autocast_adapter_dtype,
                )
        if not setup.autocast_adapter_dtype:  # peft casts adapters to the base's dtype, but skips meta ones
            for param in (p for p in model.parameters() if p.requires_grad):
                param.data = param.data.to(setup.weight_dtype)
        refuse_lora_on_experts(model, spec, setup)
    return model


def decoder_layers(model: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList:
    """The decoder layers, found as lesson 3 finds a layer stack; PlanError if there are not n_layers."""
    try:
        layers = find_layer_stack(model)
    except ValueError:
        layers = None
    if layers is None or len(layers) != n_layers:
        raise PlanError(f"cannot find the {n_layers} decoder layers of {type(model).__name__}")
    return layers
