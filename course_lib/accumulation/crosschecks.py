"""The reference loop cross-checked against Hugging Face's Trainer and against DDP in 2 processes (lesson 2)."""

from __future__ import annotations

import copy
import math
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler

from course_lib import validate
from course_lib.accumulation.batches import (
    check_accumulation_steps,
    collate_padded,
    padded_token_batches,
    padded_token_examples,
)
from course_lib.accumulation.broken import loop_class, sgd_and_schedule
from course_lib.accumulation.equivalence import max_abs
from course_lib.accumulation.loop import max_weight_difference
from course_lib.accumulation.losses import TokenLoss
from course_lib.accumulation.tiny_models import TinyTokenLM, tiny_causal_lm_config
from course_lib.measure import PlainTextTable
from course_lib.sharding.launch import run_ranks
from course_lib.validate import checked


@checked
@dataclass
class TrainerCrossCheck(PlainTextTable):
    """Final weights of the reference loop, the naive loop and HF Trainer from the same start (lesson 2)."""

    reference_vs_trainer: float  # max relative weight difference
    naive_vs_trainer: float
    reference_vs_initial: float  # how far training moved the weights (the scale of the above)
    micro_batches: int
    accumulation_steps: int
    optimizer_steps: int
    transformers_version: str

    def __str__(self) -> str:
        return (
            f"{self.micro_batches} micro-batches, gradient_accumulation_steps={self.accumulation_steps}, "
            f"{self.optimizer_steps} optimizer steps; max relative weight difference:\n"
            f"  reference loop vs Trainer: {self.reference_vs_trainer:.1e}\n"
            f"  naive per-micro-batch mean vs Trainer: {self.naive_vs_trainer:.1e}\n"
            f"  (training moved the weights by {self.reference_vs_initial:.1e})"
        )


def trainer_cross_check(
    n_sequences: int = 22,
    micro_batch_size: int = 2,
    accumulation_steps: int = 4,
    lr: float = 1e-2,
    max_grad_norm: float = 1.0,
    seed: int = 0,
) -> TrainerCrossCheck:
    """Train a tiny Llama (random weights) with HF Trainer and with our loop; compare (lesson 2).

    The data are generated variable-length sequences, right-padded per micro-batch by the same
    collator for both. Both runs start from copies of one model, use the same AdamW and linear decay
    (handed to the Trainer through `optimizers=`), the same clipping, a sequential order and
    `gradient_accumulation_steps=accumulation_steps`; `n_sequences / micro_batch_size` not a multiple
    of K exercises the short final window. Nothing is downloaded or saved.
    """
    import transformers  # off the import path: transformers takes seconds to import

    # off the import path: transformers takes seconds to import
    from transformers import LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

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
        args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=micro_batch_size,
            gradient_accumulation_steps=accumulation_steps,
            num_train_epochs=1,
            max_grad_norm=max_grad_norm,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=seed,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
        )
        trainer = SequentialTrainer(
            model=hf_model,
            args=args,
            train_dataset=examples,
            data_collator=collate_padded,
            optimizers=(hf_opt, hf_sched),
        )
        trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print the final metrics
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    batches = list(DataLoader(examples, batch_size=micro_batch_size, shuffle=False, collate_fn=collate_padded))
    results = {}
    for name, mistakes in (("reference", ()), ("naive", ("mean_per_micro_batch",))):
        model, opt, sched = fresh()
        loop_class(mistakes)(
            model, opt, TokenLoss(), accumulation_steps, scheduler=sched, max_grad_norm=max_grad_norm, progress=False
        ).run(batches)
        results[name] = model
    return TrainerCrossCheck(
        reference_vs_trainer=max_weight_difference(results["reference"], trainer.model),
        naive_vs_trainer=max_weight_difference(results["naive"], trainer.model),
        reference_vs_initial=max_weight_difference(results["reference"], initial),
        micro_batches=micro,
        accumulation_steps=accumulation_steps,
        optimizer_steps=trainer.state.global_step,
        transformers_version=transformers.__version__,
    )


# --------------------------------------------------------------------------------------------------
# Cross-check 2: DDP with no_sync, two processes on CPU (gloo)
# --------------------------------------------------------------------------------------------------


@checked
@dataclass
class DDPReport(PlainTextTable):
    """A DDP run of the reference loop against one process (lesson 2, "no_sync placement")."""

    mistakes: tuple[str, ...]
    world_size: int
    micro_batches: int  # per rank
    windows: int
    buckets: int  # gradient buckets per all-reduce round (1 for the tiny model)
    allreduces_per_window: list[int]  # gradient all-reduce rounds in each window (rank 0)
    max_diff_vs_single: float  # max relative weight difference, any rank vs the one-process run
    max_diff_between_ranks: float

    def __str__(self) -> str:
        label = ", ".join(self.mistakes) or "reference loop"
        return (
            f"{label}: all-reduces per window {self.allreduces_per_window}, "
            f"vs one process {self.max_diff_vs_single:.1e}, between ranks {self.max_diff_between_ranks:.1e}"
        )


def _ddp_data(world_size: int, n_micro: int, rows_per_rank: int, seed: int):
    """Full micro-batches and each rank's shard; rank r holds rows r::world_size of every micro-batch."""
    full = padded_token_batches(n_micro, batch_size=rows_per_rank * world_size, seed=seed)
    shards = [[{key: value[r::world_size] for key, value in mb.items()} for mb in full] for r in range(world_size)]
    return full, shards


def _ddp_train(model: nn.Module, batches, k: int, mistakes: tuple[str, ...] = (), step_hook=None) -> None:
    """SGD with momentum and a decaying schedule, the loop of `mistakes` (the reference loop for ())."""
    opt, sched = sgd_and_schedule(model, lr=0.3)
    if step_hook is not None:
        opt.register_step_post_hook(step_hook)
    loop_class(mistakes)(model, opt, TokenLoss(), k, scheduler=sched, progress=False).run(batches)


def _ddp_worker(rank: int, world_size: int, variants, n_micro: int, k: int, rows_per_rank: int, seed: int) -> dict:
    """One rank of the cross-check, in a gloo group started by `course_lib.sharding.run_ranks`."""
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
        per_window: list[int] = []
        marks = [0]

        def after_step(optimizer, args, kw):
            per_window.append(len(calls) - marks[0])
            marks[0] = len(calls)

        _ddp_train(ddp, shards[rank], k, mistakes, step_hook=after_step)
        buckets = max(calls) + 1 if calls else 1
        results[tuple(mistakes)] = {
            "state": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rounds_per_window": [c // buckets for c in per_window],
            "buckets": buckets,
        }
    return results


@checked
def ddp_accumulation_demo(
    variants: Sequence[Sequence[str]] = ((),),
    world_size: int = 2,
    n_micro: int = 6,
    accumulation_steps: int = 4,
    rows_per_rank: int = 2,
    seed: int = 0,
    timeout_s: float = 120.0,
) -> list[DDPReport]:
    """Run the reference loop under DDP in `world_size` CPU processes (gloo) and check it (lesson 2).

    Each variant (`()` for the reference loop, `(name,)` for a broken loop of `MISTAKES`) trains a tiny
    token model on each rank's shard of padded micro-batches (6 micro-batches, K=4: a full and a short
    window) and is compared with one process training on the full micro-batches. A DDP comm hook counts the
    gradient all-reduces of each window. Processes start with `spawn` on 127.0.0.1 and a free port;
    they are killed and an error is raised if they do not finish within `timeout_s`.
    """
    # one mistake's name is one variant, never its characters
    variants = [tuple(v) if isinstance(v, (list, tuple)) else (v,) for v in validate.non_empty("variants", variants)]
    world_size, n_micro, rows_per_rank = (
        validate.positive_int(name, value, maximum=most)
        for name, value, most in (
            ("world_size", world_size, 64),
            ("n_micro", n_micro, 1000),
            ("rows_per_rank", rows_per_rank, 1000),
        )
    )
    check_accumulation_steps(accumulation_steps)
    validate.positive("timeout_s", timeout_s)
    for v in variants:
        loop_class(v)  # an unknown mistake is refused before any process starts
    full, _ = _ddp_data(world_size, n_micro, rows_per_rank, seed)
    per_rank = run_ranks(
        _ddp_worker,
        world_size,
        variants,
        n_micro,
        accumulation_steps,
        rows_per_rank,
        seed,
        timeout_s=timeout_s,
        what="DDP processes",
    )
    reports = []
    for v in variants:
        single = TinyTokenLM(seed=seed)
        _ddp_train(single, full, accumulation_steps)
        states = [r[v]["state"] for r in per_rank]
        ref = dict(single.named_parameters())
        vs_single = max(
            max_abs(s[n].double() - ref[n].detach().double()) / max(max_abs(ref[n]), 1e-12) for s in states for n in s
        )
        between = (
            max(
                max_abs(s[n].double() - states[0][n].double()) / max(max_abs(states[0][n]), 1e-12)
                for s in states[1:]
                for n in s
            )
            if world_size > 1
            else 0.0
        )
        reports.append(
            DDPReport(
                mistakes=v,
                world_size=world_size,
                micro_batches=n_micro,
                windows=math.ceil(n_micro / accumulation_steps),
                buckets=per_rank[0][v]["buckets"],
                allreduces_per_window=per_rank[0][v]["rounds_per_window"],
                max_diff_vs_single=vs_single,
                max_diff_between_ranks=between,
            )
        )
    return reports
