"""The model and data a recipe trains, with no download (lesson 5): a real architecture from a config
with random weights, saved once so that `from_pretrained` quantizes it as it quantizes a hub
checkpoint; the NF4 base, prepare_model_for_kbit_training, checkpointing and LoRA on top."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from course_lib.checkpointing import hf_checkpointing
from course_lib.device import DtypePolicy, dtype_policy
from course_lib.errors import UserError
from course_lib.model_config import load_config
from course_lib.qlora.recipe import Recipe, RecipeError, valid_recipe
from course_lib.validate import Count, Device, checked


@checked(error=RecipeError)
def tiny_llama_config(
    hidden: Count = 256,
    layers: int = 2,
    heads: Count = 8,
    kv_heads: int = 4,
    intermediate: int = 688,
    vocab: int = 1024,
):
    """A Llama-architecture config small enough to train in seconds on a CPU (lesson 5)."""
    from transformers import LlamaConfig  # heavy: transformers

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        use_cache=False,
        tie_word_embeddings=False,
    )


def llama_1b_config():
    """Llama 3.2 1B's architecture (the bundled config.json): the 1B-class CUDA configuration."""

    config = load_config("llama-3.2-1b")
    config.use_cache = False
    return config


_SAVED: dict[str, Path] = {}


@checked(error=RecipeError)
def causal_lm_config(config):
    """`config` if it is a transformers model config (what `tiny_llama_config` returns); else a UserError."""
    if not callable(getattr(config, "to_json_string", None)) or not hasattr(config, "model_type"):
        raise UserError(  # one line: UserError joins a repr's lines
            f"config must be a transformers model config such as qlora.tiny_llama_config(), got "
            f"{repr(config)[:60]} ({type(config).__name__})"
        )
    return config


def checkpoint_dir(config) -> Path:
    """Random weights for `config`, saved once per config in a temporary folder (seed 0). With
    COURSE_LIB_CHECKPOINTS set, in a folder there named after the config, shared by every process
    (benchmarks/gpu_check.sh: the 1B checkpoint is written once for all its parts)."""
    from transformers import AutoModelForCausalLM  # heavy: only when a checkpoint is written

    causal_lm_config(config)
    key = config.to_json_string()
    shared = os.environ.get("COURSE_LIB_CHECKPOINTS")
    if shared and key not in _SAVED and _complete(Path(shared) / hashlib.sha1(key.encode()).hexdigest()[:16]):
        _SAVED[key] = Path(shared) / hashlib.sha1(key.encode()).hexdigest()[:16]
    if key not in _SAVED or not _complete(_SAVED[key]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)  # saving edits its config
        if shared:  # written whole, then renamed: a process killed halfway leaves no folder that looks done
            folder = Path(shared) / hashlib.sha1(key.encode()).hexdigest()[:16]
            folder.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
            with quiet():
                model.save_pretrained(partial)
            try:
                os.replace(partial, folder)
            except OSError:  # another process got there first (its folder is whole) or left a torn one
                if not _complete(folder):
                    shutil.rmtree(folder, ignore_errors=True)
                    os.replace(partial, folder)
                else:
                    shutil.rmtree(partial, ignore_errors=True)
        else:
            folder = Path(tempfile.mkdtemp(prefix="course_lib_qlora_"))
            with quiet():
                model.save_pretrained(folder)
        del model
        _SAVED[key] = folder
    return _SAVED[key]


def _complete(folder: Path) -> bool:
    """A saved checkpoint with its weights, not only the config.json that save_pretrained writes first."""
    return (folder / "config.json").exists() and any(folder.glob("model*.safetensors*"))


@contextlib.contextmanager
def quiet():
    """Keep transformers', peft's and bitsandbytes' chatter and progress bars out of the lesson."""
    from transformers.utils import logging as hf_logging  # heavy: transformers, only when a model is built

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    bnb_logger = logging.getLogger("bitsandbytes")
    old = bnb_logger.level
    bnb_logger.setLevel(logging.ERROR)
    try:  # progress bars and library chatter go to stderr: keep them out of the lesson
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:  # restore, so that nested uses leave the bars off until the outermost one ends
            hf_logging.enable_progress_bar()
        bnb_logger.setLevel(old)


@checked(error=RecipeError)
def compute_dtype(policy: DtypePolicy) -> torch.dtype:
    """The dtype of the frozen base and of NF4's compute: the policy's autocast dtype, else fp32."""
    return policy.autocast_dtype or torch.float32


def build_model(
    config,
    recipe: Recipe,
    device: Device = "cpu",
    policy: DtypePolicy | None = None,
    weights: str | Path | None = None,
):
    """The model a recipe trains (lesson 5): NF4 base via BitsAndBytesConfig (double quantization, the
    policy's compute dtype), prepare_model_for_kbit_training, non-reentrant checkpointing, LoRA on all
    linear layers. Trainable parameters are fp32 (peft's default; the T4 recipe needs it).

    The weights are random, for `config`, unless `weights` names real ones: a local checkpoint folder,
    or a Hugging Face Hub id, which downloads them (optional, on Colab say; nothing here needs it).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # heavy: transformers and bitsandbytes

    valid_recipe(recipe)
    device = torch.device(device)
    policy = policy or dtype_policy(device)
    base_dtype = compute_dtype(policy) if recipe.lora_rank else torch.float32
    kwargs = dict(dtype=base_dtype, device_map={"": device.index or 0} if device.type == "cuda" else "cpu")
    if recipe.nf4:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(policy),
        )
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(weights or checkpoint_dir(config), **kwargs)
        model.config.use_cache = False
        if recipe.nf4 and recipe.prepare_kbit:
            from peft import prepare_model_for_kbit_training  # heavy: peft, only for a 4-bit base

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if recipe.checkpointing:
            hf_checkpointing(model, True, use_reentrant=False)
        if recipe.lora_rank:
            from peft import LoraConfig, get_peft_model  # heavy: peft, only with adapters

            model = get_peft_model(
                model,
                LoraConfig(
                    r=recipe.lora_rank,
                    lora_alpha=2 * recipe.lora_rank,
                    target_modules="all-linear",
                    lora_dropout=0.0,
                    task_type="CAUSAL_LM",
                ),
            )
    return model.train()


@checked(error=RecipeError)
def counting_dataset(n: Count, seq: Count, vocab: Count, seed: int = 0) -> list[dict]:
    """`n` sequences that count upward from a random start, modulo `vocab` (lesson 5): with a `vocab`
    much smaller than the model's, a pattern adapters pick up in a few steps, so a falling loss
    means training works."""
    for value, what in ((n, "n"), (seq, "seq"), (vocab, "vocab")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{what} must be a positive integer, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n,), generator=generator)
    rows = []
    for start in starts.tolist():
        ids = (torch.arange(seq) + start) % vocab
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows
