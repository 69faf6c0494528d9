"""Lesson 5's recipe: every trick on by default, each one switched off by name (lesson 5, "the recipe")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib import validate
from course_lib.errors import UserError
from course_lib.validate import checked

# The Trainer's `optim` names and the planner's names for the same optimizer.
PLANNER_OPTIM = {"paged_adamw_8bit": "paged_adamw8bit", "adamw_8bit": "adamw8bit", "adamw_torch": "adamw"}
OPTIMS = tuple(PLANNER_OPTIM)
TRICKS = ("nf4", "lora", "checkpointing", "accumulation", "optimizer", "prepare_kbit")


class RecipeError(UserError):
    """A recipe that cannot be trained: the message says what to change (lesson 5)."""


@checked(error=RecipeError)
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
        for name in ("nf4", "checkpointing", "prepare_kbit"):
            validate.strict_bool(name, getattr(self, name), error=RecipeError)
        for value, what in ((self.batch, "batch"), (self.accum, "accum"), (self.seq, "seq")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"{what} must be a positive integer, got {value!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise RecipeError(f"lora_rank must be an integer >= 0 (0: full fine-tune), got {self.lora_rank!r}")
        validate.choice("optim", self.optim, OPTIMS, error=RecipeError)
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
        return Recipe(
            nf4=False,
            lora_rank=0,
            checkpointing=False,
            batch=self.effective_batch,
            accum=1,
            optim="adamw_torch",
            prepare_kbit=False,
            seq=self.seq,
        )

    def describe(self) -> str:
        parts = [
            "NF4-DQ base" if self.nf4 else "unquantized base",
            f"LoRA r={self.lora_rank}" if self.lora_rank else "full fine-tune",
            "checkpointing" if self.checkpointing else "no checkpointing",
            f"batch {self.batch} x accum {self.accum}",
            self.optim,
        ]
        if self.nf4:
            parts.append("prepare_kbit" if self.prepare_kbit else "no prepare_kbit")
        return ", ".join(parts)


def valid_recipe(recipe) -> Recipe:
    """`recipe` validated, or RecipeError for a bad field or for anything but a Recipe (a dict, say)."""
    return validate.instance(
        "recipe", recipe, Recipe, "a qlora.Recipe, e.g. Recipe(lora_rank=8)", error=RecipeError
    ).validate()
