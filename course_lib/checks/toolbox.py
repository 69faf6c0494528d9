"""Checks for the exercises of lesson 7 (the rest of the toolbox).

Exercise 7.1 (the optimizer step in backward) is checked by the weights after several steps, bit for
bit those of a normal step, by the gradients being gone after backward and by a measured peak below
the normal step's. Exercise 7.2 (the chunked loss) by the loss and every gradient against Hugging
Face's loss over shapes, padding and chunk sizes, and by a measured peak below one set of all the fp32
logits for a large vocabulary (a loop of chunks that keeps each chunk's log-softmax does not pass).
Neither accepts an answer that only calls the library's own implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import toolbox
from course_lib.checks.hints import passed, refusing
from course_lib.measure import MiB, optimizer_state_tensors, peak_bytes

__all__ = ["check_optimizer_in_backward", "check_chunked_loss"]

_CPU = torch.device("cpu")


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def check_optimizer_in_backward(attach_optimizer_hooks) -> None:
    """Exercise 7.1: `attach_optimizer_hooks(model, make_optimizer)` gives each trainable parameter its
    own optimizer, steps it in a post-accumulate-grad hook and frees the gradient there; it returns
    the optimizers, one per parameter."""
    attach = refusing(attach_optimizer_hooks, toolbox.OptimizerInBackward,
                      instead="write the hooks yourself (register_post_accumulate_grad_hook)")
    plain, fused = _mlp(0), _mlp(0)
    optimizer = _adamw(list(plain.parameters()))
    optimizers = attach(fused, _adamw)
    assert optimizers is not None, "attach_optimizer_hooks returned None: return the optimizers (one per parameter)"
    optimizers = list(optimizers.values()) if isinstance(optimizers, dict) else list(optimizers)
    assert len(optimizers) == len(list(fused.parameters())), (
        f"expected one optimizer per parameter ({len(list(fused.parameters()))}), got {len(optimizers)}")
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 256)
        optimizer.zero_grad(set_to_none=True)
        plain(x).pow(2).mean().backward()
        optimizer.step()
        fused(x).pow(2).mean().backward()
        left = [name for name, p in fused.named_parameters() if p.grad is not None]
        assert not left, (f"after backward {left[0]} still has a gradient: in the hook, after the step, free it "
                          "(optimizer.zero_grad(set_to_none=True), or param.grad = None)")
        for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
            # equal up to float rounding: a BLAS on several threads need not sum in the same order twice,
            # and a wrong answer misses by the learning rate (1e-2)
            if torch.allclose(p, q, rtol=1e-5, atol=1e-7):
                continue
            moved = not torch.equal(p, _mlp(0).state_dict()[name])
            raise AssertionError(
                f"after step {step + 1} the weight {name} differs from a normal AdamW step's. " +
                ("Each hook must step only its own parameter's optimizer, once per backward."
                 if moved else "It was never updated: register the hook on every trainable parameter "
                 "(param.register_post_accumulate_grad_hook) and call that parameter's optimizer.step() in it."))
    state = [t for opt in optimizers for t in optimizer_state_tensors(opt)]
    plain_state = optimizer_state_tensors(optimizer)
    x = torch.randn(8, 256)
    optimizer.zero_grad(set_to_none=True)
    normal = peak_bytes(lambda: (plain(x).pow(2).mean().backward(), optimizer.step()),
                        [*plain.parameters(), *plain_state, x], _CPU)
    fused_peak = peak_bytes(lambda: fused(x).pow(2).mean().backward(), [*fused.parameters(), *state, x], _CPU)
    assert fused_peak < normal, (f"the measured peak with the step in backward ({fused_peak / MiB:.2f} MiB) is not "
                                 f"below the normal step's ({normal / MiB:.2f} MiB): free each gradient in its hook")
    passed(f"Correct: same weights as AdamW after 3 steps; measured peak {fused_peak / MiB:.2f} MiB against "
          f"{normal / MiB:.2f} MiB for the normal step (measured, CPU).")


def _hf_loss(logits, labels):
    # off the import path: transformers takes seconds to import
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1])


def check_chunked_loss(chunked_loss) -> None:
    """Exercise 7.2: `chunked_loss(hidden, weight, labels, chunk_size)` is Hugging Face's causal LM loss
    of `F.linear(hidden, weight)` (labels shifted, -100 ignored, mean over the scored tokens), computed
    `chunk_size` tokens at a time with each chunk's logits recomputed in backward."""
    loss_of = refusing(chunked_loss, toolbox.chunked_cross_entropy, toolbox.chunked_causal_lm_loss,
                       instead="write the chunks yourself (torch.utils.checkpoint and F.cross_entropy are fine)")
    generator = torch.Generator().manual_seed(0)
    for batch, seq, hidden, vocab, chunk, padded in ((1, 7, 4, 11, 3, 0), (2, 16, 8, 50, 5, 4),
                                                      (3, 9, 6, 20, 64, 9), (2, 12, 5, 30, 1, 2)):
        h = torch.randn(batch, seq, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
        w = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels[0, seq - padded:] = -100
        where = f"batch {batch}, seq {seq}, vocabulary {vocab}, chunk_size {chunk}, {padded} padded labels"
        expected = _hf_loss(F.linear(h, w), labels)
        grads = torch.autograd.grad(expected, [h, w])
        got = loss_of(h, w, labels, chunk)
        assert isinstance(got, torch.Tensor) and got.numel() == 1, f"{where}: return the loss, a scalar tensor"
        value = got.detach().to(expected.dtype)  # fp32 like Hugging Face's upcast, whatever the answer's dtype
        if not torch.allclose(value, expected):
            unshifted = F.cross_entropy(F.linear(h, w).float().reshape(-1, vocab), labels.reshape(-1))
            hint = ("score position t on token t+1 (shift the labels left, -100 at the end), as Hugging Face does"
                    if torch.allclose(value, unshifted) else "divide the summed loss by the number of scored tokens "
                    "(labels != -100 after the shift), not by the number of chunks")
            raise AssertionError(f"{where}: loss {value.item():.6f}, expected {expected.item():.6f}: {hint}")
        got_grads = torch.autograd.grad(got, [h, w])
        for name, a, b in (("hidden", got_grads[0], grads[0]), ("weight", got_grads[1], grads[1])):
            assert torch.allclose(a, b), f"{where}: the gradient of {name} differs from the plain loss's"
    torch.manual_seed(0)
    h = torch.randn(2, 256, 32, requires_grad=True)
    w = torch.randn(8192, 32, requires_grad=True)
    labels = torch.randint(0, 8192, (2, 256))
    plain = peak_bytes(lambda: _hf_loss(F.linear(h, w), labels).backward(), [h, w, labels], _CPU)
    h.grad = w.grad = None
    chunked = peak_bytes(lambda: loss_of(h, w, labels, 64).backward(), [h, w, labels], _CPU)
    logits = labels.numel() * w.shape[0] * 4  # all the fp32 logits of the batch
    assert chunked < logits, (f"measured peak {chunked / MiB:.1f} MiB, not below one set of all the fp32 logits "
                              f"({logits / MiB:.1f} MiB; the plain loss peaks at {plain / MiB:.1f} MiB): run each "
                              "chunk's head and loss under torch.utils.checkpoint(..., use_reentrant=False) so "
                              "that backward recomputes its logits instead of keeping them all")
    passed(f"Correct: loss and gradients equal Hugging Face's; measured peak {chunked / MiB:.1f} MiB against "
          f"{plain / MiB:.1f} MiB for the plain loss (vocabulary 8192, 512 tokens, chunks of 64; measured, CPU).")
