"""Models to measure in lesson 3: an MLP stack, uneven stacks, tiny Hugging Face decoders."""

from __future__ import annotations

import re

import torch
from torch import nn

from course_lib import validate
from course_lib.errors import UserError
from course_lib.models import supported_attention
from course_lib.validate import Count, checked


@checked
def mlp_stack(n_layers: Count, width: Count, activation: str = "relu") -> nn.Sequential:
    """n_layers layers of Linear(width, width) + activation (lesson 3, "the MLP").

    With ReLU a layer saves only its input (ReLU's saved output is the next layer's input): checkpointing
    every layer saves nothing. With GELU a layer saves its input and the Linear's output: twice its input.
    """
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
    if activation not in acts:
        raise UserError(f"activation must be one of {', '.join(acts)}, got {activation!r}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), acts[activation]()) for _ in range(n_layers)])


@checked
class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)), hidden `mult` x width: stores about (2 + 2 mult) times its input,
    costs about mult times the FLOPs of a width x width matmul, twice (lesson 3, "uneven layers")."""

    def __init__(self, width: Count, mult: Count) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, mult * width)
        self.act = nn.GELU()
        self.down = nn.Linear(mult * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


@checked
class PointwiseBlock(nn.Module):
    """A cheap layer that stores a lot: one width x width matmul, then a chain of pointwise ops, each
    saving a tensor the size of its input (lesson 3, "uneven layers")."""

    def __init__(self, width: Count) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))
        gate = torch.sigmoid(h * 2.0)
        return x + torch.sin(h * gate) * torch.exp(-h * h)


@checked
def uneven_stack(spec: str, width: int) -> nn.Sequential:
    """A stack of uneven layers from a spec such as "mlp1 mlp8 pw mlp2": mlpK is a ResidualMLP with
    hidden K x width (memory and compute grow with K), pw a PointwiseBlock (lesson 3)."""
    layers = []
    for token in spec.split():
        if token == "pw":
            layers.append(PointwiseBlock(width))
        elif re.fullmatch(r"mlp\d+", token) and int(token[3:]) >= 1:
            layers.append(ResidualMLP(width, int(token[3:])))
        else:
            raise UserError(f"unknown layer {token!r} in {spec!r}: use mlpK (K >= 1) or pw")
    if not layers:
        raise UserError("the spec names no layer")
    return nn.Sequential(*layers)


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


def _decoder_config(arch: str, *, n_layers, hidden, heads, intermediate, vocab, sliding_window):
    import transformers  # off the import path: transformers takes seconds to import

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        use_cache=False,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=sliding_window)
    if arch == "qwen2":  # sliding window on the layers from max_window_layers on, as Qwen2 configures it
        return transformers.Qwen2Config(
            **common,
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window,
            max_window_layers=n_layers // 2,
        )
    if arch == "phi3":
        return transformers.Phi3Config(
            **common, sliding_window=sliding_window, pad_token_id=None, bos_token_id=vocab - 1, eos_token_id=vocab - 1
        )
    if arch == "gemma2":  # sliding and global layers alternate, each with its own mask
        return transformers.Gemma2Config(
            **common,
            head_dim=hidden // heads,
            query_pre_attn_scalar=hidden // heads,
            sliding_window=sliding_window or 4096,
        )
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=n_layers,
            n_head=heads,
            n_inner=intermediate,
            n_positions=4096,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
    raise UserError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")


@checked
def tiny_decoder(
    arch: str = "llama",
    *,
    n_layers: Count = 8,
    hidden: Count = 128,
    heads: Count = 4,
    intermediate: Count | None = None,
    vocab: Count = 512,
    attn_implementation: str = "sdpa",
    sliding_window: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """A Hugging Face causal LM built from a config with random weights, no download (lesson 3).

    `arch`: one of ARCHITECTURES (the bundled models' families: "llama", "gpt2", "mistral", "qwen2",
    "phi3", "gemma2"). `attn_implementation`: "sdpa" or "eager" (eager stores the s x s attention
    matrix); Gemma-2 refuses SDPA in transformers, so it always gets eager. `sliding_window`: the
    window of the sliding-attention layers (Mistral, Qwen2's upper half, Phi-3, Gemma-2's every
    other layer).
    """
    import transformers  # off the import path: transformers takes seconds to import

    validate.choice("attn_implementation", attn_implementation, ("sdpa", "eager"))
    config = _decoder_config(
        arch,
        n_layers=n_layers,
        hidden=hidden,
        heads=heads,
        intermediate=intermediate,
        vocab=vocab,
        sliding_window=sliding_window,
    )

    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[arch])._from_config(
        config, attn_implementation=supported_attention(config, attn_implementation)
    )
    if arch == "gpt2":
        model.loss_type = "ForCausalLM"  # GPT-2 names none; transformers warns, then uses this one
    return model.train()
