"""Real model architectures with no download: exact parameter counts from meta-device instantiation
of a bundled config or any config.json (lesson 1, "how many parameters, exactly"); the configs
themselves are read by course_lib.model_config.

A model built on the meta device has the real shapes and no memory, so its parameter count is exact,
not a formula: tied embeddings, biases, norms and grouped-query attention are counted as the Hugging
Face implementation builds them.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from course_lib.cache import cached, cached_answer, memo
from course_lib.layers import layer_of_each_module
from course_lib.model_config import (  # noqa: F401
    CONFIG_DIR,
    HUB_IDS,
    ModelNotFound,
    bundled_models,
    config_class_name,
    config_key,
    config_stamp,
    load_config,
    read_config,
    transformers_config,
)
from course_lib.validate import Device

# Published parameter counts (model cards / safetensors metadata of the Hugging Face Hub), checked
# against meta-device instantiation of the bundled configs in tests/test_models.py.
PUBLISHED_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "phi-3-mini": 3_821_079_552,
    "gemma-2-2b": 2_614_341_888,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
}


def build_model(
    config,
    device: Device = "meta",
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """A causal LM of the config's architecture with random weights (lesson 1).

    On the meta device (the default) it holds shapes and no memory: a 70B model builds in a second.
    """
    from transformers import AutoModelForCausalLM  # off the import path: transformers takes seconds to import
    from transformers.utils import logging as hf_logging  # off the import path: transformers takes seconds to import

    config = transformers_config(config)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # e.g. Gemma-2's generation flags under use_cache=False: not the user's concern
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if dtype is not None:
        model = model.to(dtype)
    return model


def legacy_causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor):
    """(loss, outputs) as transformers computed them before 4.46 (LlamaForCausalLM.forward of v4.38 to
    v4.45; lesson 1, "the planner"): the logits upcast to fp32 and returned with the outputs, the shifted
    logits copied for CrossEntropyLoss. From 4.46 the logits stay in the model's dtype and the loss
    upcasts them (docs/references.md, transformers' pull requests 31292 and 33902)."""
    outputs = model(input_ids=input_ids, use_cache=False)
    outputs.logits = outputs.logits.float()
    shift_logits = outputs.logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss = torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
    return loss, outputs


def supported_attention(config, requested: str | None) -> str | None:
    """The attention a model of this config runs: `requested`, or "eager" where transformers' class
    refuses SDPA (Gemma-2, whose attention caps its logits) (lessons 1 and 3)."""
    if requested != "sdpa":
        return requested

    def supports_sdpa() -> bool:  # imports the model's module (about a second): asked once, kept on disk
        # off the import path: transformers takes seconds to import
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers_config(config))]
        except KeyError:
            return True
        return bool(getattr(model_class, "_supports_sdpa", True))

    return requested if cached_answer("sdpa", config_class_name(config), supports_sdpa) else "eager"


@dataclass(frozen=True)
class ParamInfo:
    """One distinct parameter tensor: its name, shape and the kind of module that owns it."""

    name: str
    shape: tuple[int, ...]
    module: str  # "linear", "embedding", "norm" or "other"
    is_lm_head: bool = False
    layer: int | None = None  # the decoder layer holding it (layers.find_layer_stack), None outside the stack

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model: exact parameter tensors and the config (lesson 1)."""

    name: str
    config: object = field(repr=False)
    params: tuple[ParamInfo, ...] = field(repr=False)

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def n_tensors(self) -> int:
        return len(self.params)

    @property
    def n_layers(self) -> int | None:
        for key in ("num_hidden_layers", "n_layer"):
            value = getattr(self.config, key, None)
            if isinstance(value, int):
                return value
        return None


def _module_kind(module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":  # GPT-2's Conv1D is a Linear
        return "linear"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if "norm" in type(module).__name__.lower():
        return "norm"
    return "other"


def spec_from_model(model: torch.nn.Module, name: str, config=None) -> ModelSpec:
    """The ModelSpec of a built model: distinct parameters (tied weights once) with their owners."""
    seen: set[int] = set()
    infos = []
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layer_of = layer_of_each_module(model)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            infos.append(
                ParamInfo(
                    f"{module_name}.{param_name}" if module_name else param_name,
                    tuple(param.shape),
                    _module_kind(module),
                    module is output,
                    layer_of.get(id(module)),
                )
            )
    return ModelSpec(name, config if config is not None else getattr(model, "config", None), tuple(infos))


def _spec_of(key: str) -> ModelSpec:
    config = read_config(key)
    name = key if key in bundled_models() else Path(key).parent.name if key.endswith("config.json") else Path(key).stem

    def build() -> tuple[ParamInfo, ...]:
        try:
            model = build_model(config)
        except Exception as error:  # e.g. an encoder-decoder config: not a causal LM transformers can build
            first = " ".join(str(error).split())[:300]
            raise ModelNotFound(
                f"cannot build a causal language model from {key}: {type(error).__name__}: {first}"
            ) from None
        return spec_from_model(model, name, config).params

    return ModelSpec(name, config, cached_params(config.to_json_string(use_diff=False), build))


def cached_params(config_json: str, make) -> tuple[ParamInfo, ...]:
    """The parameter list of a config from the disk cache (course_lib.cache), or `make()` kept there."""
    return cached(
        "params",
        config_json,
        make,
        lambda params: [asdict(p) for p in params],
        lambda data: tuple(
            ParamInfo(p["name"], tuple(p["shape"]), p["module"], p["is_lm_head"], p["layer"]) for p in data
        ),
    )


def model_spec(name_or_path: str | Path) -> ModelSpec:
    """The exact parameter tensors of a bundled model or config.json, from a meta-device build."""
    key = config_key(name_or_path)
    return memo("spec", (key, config_stamp(key)), lambda: _spec_of(key))  # stamp: see config_stamp


def count_parameters(name_or_path: str | Path) -> int:
    """Exact number of distinct parameters (tied weights once) of a bundled model or config.json.

    Built on the meta device, so a 70B model costs no memory (lesson 1, "how many parameters").
    """
    return model_spec(name_or_path).n_params
