"""QLoRA with every trick on: a recipe, the model it builds, Hugging Face's Trainer running it, and an
ablation table of measured peak memory and step time beside the planner's prediction (lesson 5).

The recipe is the one the earlier lessons end with: a frozen base stored in 4-bit NF4 with double
quantization (`BitsAndBytesConfig`), LoRA adapters (peft), activation checkpointing (lesson 3),
micro-batch 1 with gradient accumulation (lesson 2) and `paged_adamw_8bit` (lessons 1 and 4). The
precision follows `course_lib.device.dtype_policy`: fp32 on a CPU (every byte exact), bf16 autocast
from compute capability 8.0, fp16 autocast with fp32 trainable parameters and a GradScaler on a T4.

Nothing is downloaded: the model is a real architecture built from a config with random weights,
saved once to a temporary folder so that `from_pretrained` can quantize it the way it quantizes a hub
checkpoint. Memory is measured by `course_lib.measure` (its live-storage tracker, or CUDA's allocator
statistics) and predicted by
`course_lib.memory.plan`: this module writes neither a measurer nor a planner.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from course_lib import offload
from course_lib.checkpointing import hf_checkpointing
from course_lib.device import DtypePolicy, dtype_policy
from course_lib.measure import format_bytes, optimizer_state_tensors, peak_bytes
from course_lib.memory import GPU, plan, Setup
from course_lib.models import build_model as meta_model, load_config, spec_from_model

# The Trainer's `optim` names and the planner's names for the same optimizer.
_PLANNER_OPTIM = {"paged_adamw_8bit": "paged_adamw8bit", "adamw_8bit": "adamw8bit", "adamw_torch": "adamw"}
OPTIMS = tuple(_PLANNER_OPTIM)
TRICKS = ("nf4", "lora", "checkpointing", "accumulation", "optimizer", "prepare_kbit")


class RecipeError(ValueError):
    """A recipe that cannot be trained: the message says what to change (lesson 5)."""


@dataclass(frozen=True)
class Recipe:
    """How to fine-tune (lesson 5, "the recipe"). Defaults: every trick on.

    nf4: frozen base in 4-bit NF4 with double quantization (needs lora_rank > 0).
    lora_rank: LoRA adapters of this rank on every linear layer but the output; 0 trains everything.
    checkpointing: activation checkpointing of every decoder layer (non-reentrant).
    batch, accum: micro-batch size and gradient accumulation steps (effective batch = batch * accum).
    optim: the Trainer's optimizer name: "paged_adamw_8bit", "adamw_8bit" or "adamw_torch".
    prepare_kbit: peft's prepare_model_for_kbit_training (upcasts the non-quantized parameters to fp32).
    """

    nf4: bool = True
    lora_rank: int = 16
    checkpointing: bool = True
    batch: int = 1
    accum: int = 4
    optim: str = "paged_adamw_8bit"
    prepare_kbit: bool = True
    seq: int = 64

    def validate(self) -> Recipe:
        """The recipe itself, or RecipeError naming the bad value."""
        for value, what in ((self.batch, "batch"), (self.accum, "accum"), (self.seq, "seq")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"{what} must be a positive integer, got {value!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise RecipeError(f"lora_rank must be an integer >= 0 (0: full fine-tune), got {self.lora_rank!r}")
        if self.optim not in OPTIMS:
            raise RecipeError(f"unknown optim {self.optim!r}: use one of {', '.join(OPTIMS)}")
        if self.nf4 and not self.lora_rank:
            raise RecipeError("nf4=True freezes a 4-bit base that cannot be trained: set lora_rank > 0 (QLoRA)")
        return self

    @property
    def effective_batch(self) -> int:
        return self.batch * self.accum

    def without(self, trick: str) -> Recipe:
        """This recipe with one trick switched off (same effective batch)."""
        if trick == "nf4":
            return replace(self, nf4=False, prepare_kbit=False)
        if trick == "lora":
            return replace(self, lora_rank=0, nf4=False, prepare_kbit=False)
        if trick == "checkpointing":
            return replace(self, checkpointing=False)
        if trick == "accumulation":
            return replace(self, batch=self.effective_batch, accum=1)
        if trick == "optimizer":
            return replace(self, optim="adamw_torch")
        if trick == "prepare_kbit":
            return replace(self, prepare_kbit=False)
        raise RecipeError(f"unknown trick {trick!r}: use one of {', '.join(TRICKS)}")

    def all_off(self) -> Recipe:
        """A plain full fine-tune: no trick at all, the whole effective batch in one micro-batch."""
        return Recipe(nf4=False, lora_rank=0, checkpointing=False, batch=self.effective_batch, accum=1,
                      optim="adamw_torch", prepare_kbit=False, seq=self.seq)

    def describe(self) -> str:
        parts = ["NF4-DQ base" if self.nf4 else "unquantized base",
                 f"LoRA r={self.lora_rank}" if self.lora_rank else "full fine-tune",
                 "checkpointing" if self.checkpointing else "no checkpointing",
                 f"batch {self.batch} x accum {self.accum}", self.optim]
        if self.nf4:
            parts.append("prepare_kbit" if self.prepare_kbit else "no prepare_kbit")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------------

def tiny_llama_config(hidden: int = 256, layers: int = 2, heads: int = 8, kv_heads: int = 4,
                      intermediate: int = 688, vocab: int = 1024):
    """A Llama-architecture config small enough to train in seconds on a CPU (lesson 5)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=2048, use_cache=False, tie_word_embeddings=False)


def llama_1b_config():
    """Llama 3.2 1B's architecture (the bundled config.json): the 1B-class CUDA configuration."""

    config = load_config("llama-3.2-1b")
    config.use_cache = False
    return config


_SAVED: dict[str, Path] = {}


def _checkpoint_dir(config) -> Path:
    """Random weights for `config`, saved once per config in a temporary folder (seed 0). With
    COURSE_LIB_CHECKPOINTS set, in a folder there named after the config, shared by every process
    (benchmarks/gpu_check.sh: the 1B checkpoint is written once for all its parts)."""
    import hashlib
    import os

    from transformers import AutoModelForCausalLM

    key = config.to_json_string()
    shared = os.environ.get("COURSE_LIB_CHECKPOINTS")
    if shared and key not in _SAVED:
        folder = Path(shared) / hashlib.sha1(key.encode()).hexdigest()[:16]
        if (folder / "config.json").exists():
            _SAVED[key] = folder
    if key not in _SAVED or not (_SAVED[key] / "config.json").exists():
        folder = Path(shared) / hashlib.sha1(key.encode()).hexdigest()[:16] if shared else \
            Path(tempfile.mkdtemp(prefix="course_lib_qlora_"))
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with _quiet():
            model.save_pretrained(folder)
        del model
        _SAVED[key] = folder
    return _SAVED[key]


@contextlib.contextmanager
def _quiet():
    import logging

    from transformers.utils import logging as hf_logging

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


def compute_dtype(policy: DtypePolicy) -> torch.dtype:
    """The dtype of the frozen base and of NF4's compute: the policy's autocast dtype, else fp32."""
    return policy.autocast_dtype or torch.float32


def build_model(config, recipe: Recipe, device: str | torch.device = "cpu", policy: DtypePolicy | None = None,
                weights: str | Path | None = None):
    """The model a recipe trains (lesson 5): NF4 base via BitsAndBytesConfig (double quantization, the
    policy's compute dtype), prepare_model_for_kbit_training, non-reentrant checkpointing, LoRA on all
    linear layers. Trainable parameters are fp32 (peft's default; the T4 recipe needs it).

    The weights are random, for `config`, unless `weights` names real ones: a local checkpoint folder,
    or a Hugging Face Hub id, which downloads them (optional, on Colab say; nothing here needs it).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    recipe.validate()
    device = torch.device(device)
    policy = policy or dtype_policy(device)
    base_dtype = compute_dtype(policy) if recipe.lora_rank else torch.float32
    kwargs = dict(dtype=base_dtype, device_map={"": device.index or 0} if device.type == "cuda" else "cpu")
    if recipe.nf4:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(policy))
    with _quiet():
        model = AutoModelForCausalLM.from_pretrained(weights or _checkpoint_dir(config), **kwargs)
        model.config.use_cache = False
        if recipe.nf4 and recipe.prepare_kbit:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if recipe.checkpointing:

            hf_checkpointing(model, True, use_reentrant=False)
        if recipe.lora_rank:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=recipe.lora_rank, lora_alpha=2 * recipe.lora_rank, target_modules="all-linear",
                lora_dropout=0.0, task_type="CAUSAL_LM"))
    return model.train()


def counting_dataset(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` sequences that count upward from a random start, modulo `vocab` (lesson 5): with a `vocab`
    much smaller than the model's, a pattern adapters pick up in a few steps, so a falling loss
    means training works."""
    for value, what in ((n, "n"), (seq, "seq"), (vocab, "vocab")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n,), generator=generator)
    rows = []
    for start in starts.tolist():
        ids = (torch.arange(seq) + start) % vocab
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


# ---------------------------------------------------------------------------------------------------
# Training with Hugging Face's Trainer
# ---------------------------------------------------------------------------------------------------

def training_arguments(recipe: Recipe, output_dir: str | Path, *, max_steps: int, learning_rate: float = 2e-3,
                       device: str | torch.device = "cpu", policy: DtypePolicy | None = None):
    """The Trainer's arguments for a recipe (lesson 5): the four tricks are four arguments, the
    precision is the device's policy (fp16=True on a T4, bf16=True from compute capability 8.0)."""
    from transformers import TrainingArguments

    recipe.validate()
    device = torch.device(device)
    policy = policy or dtype_policy(device)
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    checkpointing = {name: recipe.checkpointing,
                     f"{name}_kwargs": {"use_reentrant": False} if recipe.checkpointing else None}
    return TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=recipe.batch,
        gradient_accumulation_steps=recipe.accum, **checkpointing, optim=recipe.optim,
        learning_rate=learning_rate, max_steps=max_steps, warmup_steps=0, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[],
        fp16=policy.autocast_dtype == torch.float16, bf16=policy.autocast_dtype == torch.bfloat16,
        use_cpu=device.type == "cpu", dataloader_num_workers=0, seed=0, disable_tqdm=True,
        remove_unused_columns=False)


@dataclass
class TrainResult:
    losses: list[float]
    seconds: float
    model: torch.nn.Module


def train(config, recipe: Recipe, dataset: list[dict], *, max_steps: int, learning_rate: float = 2e-3,
          device: str | torch.device = "cpu", policy: DtypePolicy | None = None,
          weights: str | Path | None = None) -> TrainResult:
    """Fine-tune with Hugging Face's Trainer and return the loss of every optimizer step (lesson 5).
    `policy` defaults to the device's (`course_lib.device.dtype_policy`); `weights` as in `build_model`."""
    from transformers import PrinterCallback, Trainer

    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
    if len(dataset) < recipe.effective_batch:
        raise ValueError(f"the dataset has {len(dataset)} rows, fewer than one effective batch "
                         f"({recipe.effective_batch})")
    model = build_model(config, recipe, device, policy, weights)
    with tempfile.TemporaryDirectory() as folder, _quiet():
        args = training_arguments(recipe, folder, max_steps=max_steps, learning_rate=learning_rate, device=device,
                                  policy=policy)
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)  # the losses are returned, not printed
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return TrainResult(losses, seconds, model)


# ---------------------------------------------------------------------------------------------------
# Measured and predicted
# ---------------------------------------------------------------------------------------------------

def make_optimizer(model: torch.nn.Module, optim: str, lr: float = 2e-3) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for `optim`, over the trainable parameters (lesson 5); lesson
    4's `offload.make_optimizer` makes it."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    with _quiet():
        return offload.make_optimizer("adamw" if optim == "adamw_torch" else optim, trainable, lr)


def planner_setup(recipe: Recipe, policy: DtypePolicy) -> Setup:
    """The planner's Setup for a recipe under a precision policy (lesson 5)."""
    recipe.validate()
    if recipe.lora_rank:  # frozen base in the compute dtype, fp32 adapters
        precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(policy.autocast_dtype, "fp32")
    else:  # fp32 trainable weights (the policy's), autocast only changes activations
        precision = "fp32"
    return Setup(precision=precision, optimizer=_PLANNER_OPTIM[recipe.optim], lora_rank=recipe.lora_rank,
                 quant="nf4-dq" if recipe.nf4 else "none", prepare_kbit=recipe.nf4 and recipe.prepare_kbit,
                 batch=recipe.batch, seq=recipe.seq, accum=recipe.accum,
                 checkpointing="every-layer" if recipe.checkpointing else "none")


def predict(config, recipe: Recipe, policy: DtypePolicy | None = None, gpu=None):
    """The planner's prediction for a recipe (`course_lib.memory.plan`), as a Plan (lesson 5)."""

    policy = policy or dtype_policy(torch.device("cpu"))
    spec = spec_from_model(meta_model(config), getattr(config, "model_type", "model"), config)
    return plan(spec, planner_setup(recipe, policy), gpu=gpu, suggest=False)


@dataclass
class Row:
    """One line of the ablation table: a recipe, its measured and predicted peak, its step time."""

    label: str
    recipe: Recipe
    measured_peak: int | None  # None: not measured, `status` says why
    predicted_peak: int
    step_ms: float | None
    trainable: int
    status: str = "measured"  # or "predicted not to fit", "out of memory"

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None when the row was not run."""
        if self.measured_peak is None:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def measure_recipe(config, recipe: Recipe, device: str | torch.device = "cpu", *, timed_steps: int = 1,
                   label: str = "", policy: DtypePolicy | None = None, gpu: GPU | None = None,
                   weights: str | Path | None = None) -> Row:
    """Build the recipe's model, run one optimizer step unmeasured (the optimizer state appears), time
    whole optimizer steps (accum micro-batches and the update), then measure the peak of one more,
    beside the planner's prediction of the same recipe (lesson 5).

    On CUDA, a recipe the planner predicts not to fit `gpu` (default: the device itself) is not run,
    and one that runs out of memory is reported as such. `policy` and `gpu` default to the device's;
    those `emulate_t4()` returns run the T4 recipe on a larger GPU (benchmarks/gpu_qlora.py --as-t4).
    `timed_steps=0` measures the peak only (no step time). `weights` as in `build_model`. A paged
    optimizer's state stays in this process until it ends:
    on CUDA, measure each recipe in its own process (`ablation` does).
    """
    recipe.validate()
    if isinstance(timed_steps, bool) or not isinstance(timed_steps, int) or timed_steps < 0:
        raise ValueError(f"timed_steps must be a whole number >= 0 (0: the peak only), got {timed_steps!r}")
    device = torch.device(device)
    if gpu is not None and device.type != "cuda":
        raise ValueError("gpu= sets the memory a CUDA run may use: it needs device='cuda'")
    policy = policy or dtype_policy(device)
    if device.type == "cuda":
        gpu = gpu or _catalog_gpu(device)
    predicted = predict(config, recipe, policy, gpu=gpu)
    predicted_peak = predicted.total - predicted.bytes["overhead"]
    label = label or recipe.describe()
    if gpu is not None and predicted.total > 0.95 * min(gpu.memory_bytes, torch.cuda.mem_get_info(device)[0]):
        return Row(label, recipe, None, predicted_peak, None, predicted.trainable_params, "predicted not to fit")
    try:
        return _measure(config, recipe, device, policy, timed_steps, label, predicted_peak, weights)
    except torch.cuda.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the model and the optimizer
    offload.release_cuda_memory()
    return Row(label, recipe, None, predicted_peak, None, predicted.trainable_params, "out of memory")


def recipe_step(model, recipe: Recipe, policy: DtypePolicy, ids: torch.Tensor):
    """The optimizer and a function running one whole optimizer step of `recipe` (every micro-batch and
    the update, with the policy's autocast and GradScaler), as the Trainer runs it (lesson 5)."""
    device = ids.device
    optimizer = make_optimizer(model, recipe.optim)
    scaler = torch.amp.GradScaler(device.type) if policy.grad_scaler else None

    def optimizer_step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(recipe.accum):
            with torch.autocast(device.type, dtype=policy.autocast_dtype, enabled=policy.autocast_dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss / recipe.accum
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    return optimizer, optimizer_step


def _measure(config, recipe: Recipe, device: torch.device, policy: DtypePolicy, timed_steps: int, label: str,
             predicted_peak: int, weights: str | Path | None = None) -> Row:
    model = build_model(config, recipe, device, policy, weights)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (recipe.batch, recipe.seq), generator=generator).to(device)
    optimizer, optimizer_step = recipe_step(model, recipe, policy, ids)

    with _quiet():
        optimizer_step()  # unmeasured: the optimizer state appears
        times = []
        for _ in range(timed_steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimizer_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        measured = _peak_of_step(optimizer_step, model, optimizer, ids, device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model, optimizer
    if device.type == "cuda":
        offload.release_cuda_memory()
    return Row(label, recipe, measured, predicted_peak, 1000 * statistics.median(times) if times else None, trainable)


def _peak_of_step(step, model, optimizer, ids, device: torch.device) -> int:
    """Peak bytes of one whole optimizer step (every micro-batch and the update), measured by
    `course_lib.measure.peak_bytes` (lesson 0's measurer, run over the whole accumulation window)."""
    optimizer.zero_grad(set_to_none=True)
    return peak_bytes(step, [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), ids], device)


def _catalog_gpu(device: torch.device):

    props = torch.cuda.get_device_properties(device)
    return GPU(props.name, props.total_memory, (props.major, props.minor))


def ablation(config, recipe: Recipe | None = None, device: str | torch.device = "cpu", *,
             timed_steps: int = 1, policy: DtypePolicy | None = None, gpu: GPU | None = None,
             isolate: bool | None = None, as_t4: bool = False, progress=None) -> list[Row]:
    """Each trick switched off in turn, then all off, measured and predicted (lesson 5, "what each
    trick buys"). `policy` and `gpu` as in `measure_recipe`.

    `isolate` (the default on CUDA) measures each row in its own process from one checkpoint saved
    once: paged optimizer state is never freed, so rows in one process would see each other's. There
    `as_t4` runs each row under `emulate_t4` (policy and gpu are then the child's, not arguments).
    `progress(rows)` is called with the rows so far after each isolated row (to save them)."""
    recipe = (recipe or Recipe()).validate()
    device = torch.device(device)
    cases = [("all tricks on", recipe)]
    names = {"nf4": "no 4-bit base (16/32-bit base)", "checkpointing": "no checkpointing",
             "accumulation": f"no accumulation (batch {recipe.effective_batch})",
             "optimizer": "32-bit AdamW, not paged 8-bit", "prepare_kbit": "no prepare_model_for_kbit_training",
             "lora": "no LoRA (full fine-tune, no NF4)"}
    for trick in ("nf4", "prepare_kbit", "checkpointing", "accumulation", "optimizer", "lora"):
        off = recipe.without(trick)
        if off != recipe:
            cases.append((names[trick], off))
    cases.append(("all tricks off", recipe.all_off()))
    if isolate if isolate is not None else device.type == "cuda":
        if policy is not None or gpu is not None:
            raise ValueError("isolated rows pick their policy in the child: pass as_t4=True, not policy/gpu")
        from course_lib.qlora_gpu import isolated_rows

        return isolated_rows(config, cases, device, timed_steps=timed_steps, as_t4=as_t4, progress=progress)
    return [measure_recipe(config, r, device, timed_steps=timed_steps, label=label, policy=policy, gpu=gpu)
            for label, r in cases]


def format_ablation(rows: list[Row]) -> str:
    """The ablation as a text table: measured and predicted peak, the error, the step time."""
    head = rows[0].measured_peak or 1 if rows else 1
    width = max(len(r.label) for r in rows)
    lines = [f"{'configuration':<{width}}  {'measured':>10}  {'predicted':>10}  {'error':>6}  "
             f"{'x all-on':>8}  {'step ms':>8}"]
    for r in rows:
        if r.measured_peak is None:
            lines.append(f"{r.label:<{width}}  {'-':>10}  {format_bytes(r.predicted_peak):>10}  ({r.status})")
            continue
        lines.append(f"{r.label:<{width}}  {format_bytes(r.measured_peak):>10}  {format_bytes(r.predicted_peak):>10}"
                     f"  {r.error:>+6.1%}  {r.measured_peak / head:>8.2f}  {'-' if r.step_ms is None else f'{r.step_ms:.0f}':>8}")
    return "\n".join(lines)


def __getattr__(name: str):
    """`emulate_t4` and `expandable_segments_effect` live in `course_lib.qlora_gpu` (CUDA runs)."""
    if name in ("emulate_t4", "expandable_segments_effect"):
        from course_lib import qlora_gpu

        return getattr(qlora_gpu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Recipe", "RecipeError", "Row", "TRICKS", "ablation", "build_model", "counting_dataset",
           "emulate_t4", "expandable_segments_effect",
           "format_ablation", "llama_1b_config", "make_optimizer", "measure_recipe", "planner_setup",
           "predict", "tiny_llama_config", "train", "training_arguments"]
