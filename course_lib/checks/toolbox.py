"""Checks for the exercises of lesson 7 (the rest of the toolbox).

Exercise 7.1 (the optimizer step in backward) is checked by one distinct optimizer per parameter,
each holding only its own, by the weights after several steps (those of a normal step up to float
rounding), by the gradients being gone after backward and by a measured peak below the normal
step's. Exercise 7.2 (the chunked loss) by the loss and every gradient against Hugging Face's loss over
shapes, padding and chunk sizes, in fp32 and on bf16 inputs (where the fp32 upcast of the logits shows),
by no product of the output layer longer than `chunk_size` tokens, and by a measured peak below one set
of all the fp32 logits for a large vocabulary (a loop of chunks that keeps each chunk's log-softmax does
not pass). Neither accepts an answer that only calls the library's own implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import toolbox
from course_lib.checks.hints import passed, refusing
from course_lib.measure import MiB, optimizer_state_tensors, peak_bytes
from course_lib.validate import checked

__all__ = ["check_optimizer_in_backward", "check_chunked_loss"]

_CPU = torch.device("cpu")


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


@checked
def check_optimizer_in_backward(attach_optimizer_hooks: Callable) -> None:
    """Exercise 7.1: `attach_optimizer_hooks(model, make_optimizer)` gives each trainable parameter its
    own optimizer, steps it in a post-accumulate-grad hook and frees the gradient there; it returns
    the optimizers, one per parameter."""
    attach = refusing(
        attach_optimizer_hooks,
        toolbox.OptimizerInBackward,
        instead="write the hooks yourself (register_post_accumulate_grad_hook)",
    )
    plain, fused = _mlp(0), _mlp(0)
    optimizer = _adamw(list(plain.parameters()))
    optimizers = attach(fused, _adamw)
    assert optimizers is not None, "attach_optimizer_hooks returned None: return the optimizers (one per parameter)"
    optimizers = list(optimizers.values()) if isinstance(optimizers, dict) else list(optimizers)
    distinct = list({id(opt): opt for opt in optimizers}.values())
    assert len(distinct) == len(list(fused.parameters())), (
        f"expected one optimizer per parameter ({len(list(fused.parameters()))} distinct optimizer objects), got "
        f"{len(distinct)}: call make_optimizer([p]) once for each parameter"
    )
    for opt in distinct:
        held = [p for group in opt.param_groups for p in group["params"]]
        assert len(held) == 1, (
            f"an optimizer holds {len(held)} parameters: give each parameter its own, "
            "make_optimizer([p]), so that its hook steps that parameter alone"
        )
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 256)
        optimizer.zero_grad(set_to_none=True)
        plain(x).pow(2).mean().backward()
        optimizer.step()
        fused(x).pow(2).mean().backward()
        left = [name for name, p in fused.named_parameters() if p.grad is not None]
        assert not left, (
            f"after backward {left[0]} still has a gradient: in the hook, after the step, free it "
            "(optimizer.zero_grad(set_to_none=True), or param.grad = None)"
        )
        for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
            # equal up to float rounding: a BLAS on several threads need not sum in the same order twice,
            # and a wrong answer misses by the learning rate (1e-2)
            if torch.allclose(p, q, rtol=1e-5, atol=1e-7):
                continue
            moved = not torch.equal(p, _mlp(0).state_dict()[name])
            raise AssertionError(
                f"after step {step + 1} the weight {name} differs from a normal AdamW step's. "
                + (
                    "Each hook must step only its own parameter's optimizer, once per backward."
                    if moved
                    else "It was never updated: register the hook on every trainable parameter "
                    "(param.register_post_accumulate_grad_hook) and call that parameter's optimizer.step() in it."
                )
            )
    state = [t for opt in optimizers for t in optimizer_state_tensors(opt)]
    plain_state = optimizer_state_tensors(optimizer)
    x = torch.randn(8, 256)
    optimizer.zero_grad(set_to_none=True)
    normal = peak_bytes(
        lambda: (plain(x).pow(2).mean().backward(), optimizer.step()), [*plain.parameters(), *plain_state, x], _CPU
    )
    fused_peak = peak_bytes(lambda: fused(x).pow(2).mean().backward(), [*fused.parameters(), *state, x], _CPU)
    assert fused_peak < normal, (
        f"the measured peak with the step in backward ({fused_peak / MiB:.2f} MiB) is not "
        f"below the normal step's ({normal / MiB:.2f} MiB): free each gradient in its hook"
    )
    passed(
        f"Correct: the weights of AdamW after 3 steps (up to float rounding); measured peak {fused_peak / MiB:.2f} MiB against "
        f"{normal / MiB:.2f} MiB for the normal step (measured, CPU)."
    )


def _hf_loss(logits, labels):
    # off the import path: transformers takes seconds to import
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1])


class _LongestHead(TorchDispatchMode):
    """The most rows of any product whose last dimension is the vocabulary (the output layer's)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            and out.shape[-1] == self.vocab
        ):
            self.rows = max(self.rows, out.numel() // self.vocab)
        return out


@checked
def check_chunked_loss(chunked_loss: Callable) -> None:
    """Exercise 7.2: `chunked_loss(hidden, weight, labels, chunk_size)` is Hugging Face's causal LM loss
    of `F.linear(hidden, weight)` (labels shifted, -100 ignored, logits upcast to fp32, mean over the
    scored tokens), computed `chunk_size` tokens at a time with each chunk's logits recomputed in backward."""
    loss_of = refusing(
        chunked_loss,
        toolbox.chunked_cross_entropy,
        toolbox.chunked_causal_lm_loss,
        instead="write the chunks yourself (torch.utils.checkpoint and F.cross_entropy are fine)",
    )
    generator = torch.Generator().manual_seed(0)
    for batch, seq, hidden, vocab, chunk, padded, dtype in (
        (1, 7, 4, 11, 3, 0, torch.float32),
        (2, 16, 8, 50, 5, 4, torch.float32),
        (3, 9, 6, 20, 64, 9, torch.float32),
        (2, 12, 5, 30, 1, 2, torch.float32),
        (2, 16, 32, 512, 6, 3, torch.bfloat16),
    ):
        h = torch.randn(batch, seq, hidden, generator=generator).to(dtype).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=generator) * 3).to(dtype).requires_grad_()
        labels = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels[0, seq - padded :] = -100
        where = (
            f"batch {batch}, seq {seq}, vocabulary {vocab}, chunk_size {chunk}, {padded} padded labels, "
            f"{str(dtype).replace('torch.', '')} inputs"
        )
        expected = _hf_loss(F.linear(h, w), labels)
        grads = torch.autograd.grad(expected, [h, w])
        with _LongestHead(vocab) as head:
            got = loss_of(h, w, labels, chunk)
        assert isinstance(got, torch.Tensor) and got.numel() == 1, f"{where}: return the loss, a scalar tensor"
        assert head.rows <= chunk, (
            f"{where}: the output layer ran on {head.rows} tokens at once: compute the "
            f"logits of at most chunk_size ({chunk}) tokens at a time"
        )
        value = got.detach().float()
        if not torch.allclose(value, expected, rtol=1e-5, atol=1e-6):
            unshifted = F.cross_entropy(F.linear(h, w).float().reshape(-1, vocab), labels.reshape(-1))
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
            no_upcast = F.cross_entropy(F.linear(h, w).reshape(-1, vocab), targets, ignore_index=-100).float()
            if dtype != torch.float32 and torch.allclose(value, no_upcast, rtol=2e-2, atol=1e-2):
                hint = "upcast each chunk's logits to fp32 (.float()) before the cross-entropy, as Hugging Face does"
            elif torch.allclose(value, unshifted, rtol=1e-5, atol=1e-6):
                hint = "score position t on token t+1 (shift the labels left, -100 at the end), as Hugging Face does"
            else:
                hint = (
                    "divide the summed loss by the number of scored tokens (labels != -100 after the shift), "
                    "not by the number of chunks; in 16 bits, upcast each chunk's logits to fp32 first"
                )
            raise AssertionError(f"{where}: loss {value.item():.6f}, expected {expected.item():.6f}: {hint}")
        got_grads = torch.autograd.grad(got, [h, w])
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        for name, a, b in (("hidden", got_grads[0], grads[0]), ("weight", got_grads[1], grads[1])):
            assert torch.allclose(a.float(), b.float(), **tolerance), (
                f"{where}: the gradient of {name} differs from the plain loss's"
            )
    torch.manual_seed(0)
    h = torch.randn(2, 256, 32, requires_grad=True)
    w = torch.randn(8192, 32, requires_grad=True)
    labels = torch.randint(0, 8192, (2, 256))
    plain = peak_bytes(lambda: _hf_loss(F.linear(h, w), labels).backward(), [h, w, labels], _CPU)
    h.grad = w.grad = None
    chunked = peak_bytes(lambda: loss_of(h, w, labels, 64).backward(), [h, w, labels], _CPU)
    logits = labels.numel() * w.shape[0] * 4  # all the fp32 logits of the batch
    assert chunked < logits, (
        f"measured peak {chunked / MiB:.1f} MiB, not below one set of all the fp32 logits "
        f"({logits / MiB:.1f} MiB; the plain loss peaks at {plain / MiB:.1f} MiB): run each "
        "chunk's head and loss under torch.utils.checkpoint(..., use_reentrant=False) so "
        "that backward recomputes its logits instead of keeping them all"
    )
    passed(
        f"Correct: loss and gradients equal Hugging Face's; measured peak {chunked / MiB:.1f} MiB against "
        f"{plain / MiB:.1f} MiB for the plain loss (vocabulary 8192, 512 tokens, chunks of 64; measured, CPU)."
    )
