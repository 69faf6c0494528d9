"""`torch.autocast` for the planner's meta-device trace: the Trainer's mixed precision, fp32 weights and
gradients with 16-bit compute (lesson 1, "the planner"; lesson 5, "the T4 precision recipe").

`torch.autocast` lives at the dispatcher's Autocast keys (AutocastCPU, AutocastCUDA), which a meta tensor
does not have: under `torch.autocast("cpu")` a meta step runs as if there were no autocast. `MetaAutocast`
does what autocast does one level up, as a TorchFunctionMode (above autograd, like autocast itself, so that
autograd records each cast and a 16-bit op saves its 16-bit inputs for backward, not the fp32 ones). Its
policy is autocast's (aten/src/ATen/autocast_mode.h and .cpp, torch 2.13):

- an op of the lower-precision list (matmuls, linear layers, convolutions, SDPA) runs on 16-bit copies of
  its floating inputs; an op of the fp32 list (losses, and on CUDA exp, log, pow, layer_norm, ...) on
  fp32 copies; an op of CUDA's fp32-with-dtype list (softmax, sum, ...) is asked for an fp32 result
  unless a dtype is given; an op of the promote list runs in the widest floating dtype of its inputs;
  float64 is never cast; every other op runs on what it is given.
- `cached_cast`: the 16-bit copy of an fp32 leaf tensor that requires grad and is no view (a trained
  weight) is cached until the autocast region ends (`torch.autocast.__exit__` clears the cache at the
  outermost exit). Each trained weight is cast once per forward and its copy lives through the whole
  forward, then as long as backward needs it; a frozen weight is cast again at every call.

It sees the calls Python makes (F.linear, torch.matmul, a tensor's methods and operators), not the ops a
C++ composite makes inside itself, which autocast casts too (einsum's bmm on CPU); the Hugging Face
decoders the planner traces call the listed ops from Python. HF's `maybe_autocast` does nothing on meta
tensors, so a region the model itself runs without autocast is not seen either (GPT-2's
`reorder_and_upcast_attn`). `tests/planner/test_planner.py` checks the CPU policy against `torch.autocast("cpu")`,
in bf16 and fp16, on the ops the decoders call and some they do not (25 calls, not every listed op); the
CUDA lists are read from torch's source and not yet checked on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

# torch 2.13, aten/src/ATen/autocast_mode.cpp, as the Python functions and tensor methods that reach them
# are named (F.cross_entropy is aten::cross_entropy_loss; `a @ b` is Tensor.__matmul__)
_LOWER = {
    "cpu": {
        "conv1d",
        "conv2d",
        "conv3d",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "addbmm",
        "linear",
        "matmul",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "prelu",
        "scaled_dot_product_attention",
    },
    "cuda": {
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "scaled_dot_product_attention",
    },
}
_LOSSES = {
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
}
_FP32 = {
    "cpu": _LOSSES
    | {
        "cross_entropy",
        "binary_cross_entropy",
        "ctc_loss",
        "avg_pool3d",
        "max_pool3d",
        "adaptive_avg_pool3d",
        "grid_sampler",
        "polar",
        "prod",
        "quantile",
        "nanquantile",
        "stft",
        "cdist",
        "trace",
        "view_as_complex",
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",
        "orgqr",
        "ormqr",
        "pinverse",
        "max_unpool2d",
        "max_unpool3d",
    },
    # CUDA runs cross_entropy_loss (a composite) as log_softmax in fp32 and nll_loss in fp32
    "cuda": _LOSSES
    | {
        "cross_entropy",
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "rpow",
        "softplus",
        "layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "norm",
    },
}
_FP32_DTYPE = {
    "cpu": set(),
    "cuda": {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum"},
}
_PROMOTE = {
    "cpu": {"stack", "cat", "index_copy"},
    "cuda": {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "grid_sampler",
        "index_put",
        "scatter_add",
        "tensordot",
    },
}
POLICIES = ("lower", "fp32", "fp32_dtype", "promote")


def policy(name: str, target: str) -> str | None:
    """What autocast on `target` ("cpu" or "cuda") does to the op a Python function or tensor method of
    this name reaches: one of POLICIES, or None (it runs as it is)."""
    name = name[2:-2] if name.startswith("__") and name.endswith("__") else name
    for kind, table in zip(POLICIES, (_LOWER, _FP32, _FP32_DTYPE, _PROMOTE)):
        if name in table[target]:
            return kind
    return None


def _eligible(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class MetaAutocast(TorchFunctionMode):
    """`torch.autocast(target, dtype)` on meta tensors, over one autocast region (a `with` block: the
    forward and the loss, as the Trainer runs them). `on_cache(nbytes)` is told of each weight copy
    the cache keeps (lesson 1, "the planner")."""

    def __init__(self, dtype: torch.dtype, target: str, on_cache: Callable[[int], None] = lambda nbytes: None):
        super().__init__()
        self.dtype, self.target, self.on_cache = dtype, target, on_cache
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its copy)

    def __exit__(self, *exc):
        self.cache.clear()  # the copies live on only where autograd saved them
        return super().__exit__(*exc)

    def cached_cast(self, value, dtype: torch.dtype):
        """autocast_mode.cpp's `cached_cast`: `value` in `dtype`, the copy of a trained weight cached."""
        if not _eligible(value) or value.dtype == dtype:
            return value
        if not (
            dtype == self.dtype
            and value.dtype == torch.float32
            and value.requires_grad
            and value.is_leaf
            and not value._is_view()
        ):
            return value.to(dtype)
        if id(value) not in self.cache:
            copy = value.to(dtype)
            self.cache[id(value)] = (value, copy)
            self.on_cache(copy.untyped_storage().nbytes())
        return self.cache[id(value)][1]

    def cast(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments autocast would pass on to the op called `name`."""
        kind = policy(name, self.target)
        if kind == "fp32_dtype":
            if args and _eligible(args[0]) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        if kind is None:
            return args, kwargs
        dtype = {"lower": self.dtype, "fp32": torch.float32}.get(kind)
        if kind == "promote":
            floats = [value.dtype for value in tree_leaves((args, kwargs)) if _eligible(value)]
            dtype = torch.float32 if torch.float32 in floats else self.dtype
        return tree_map(lambda value: self.cached_cast(value, dtype), (args, kwargs))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = self.cast(getattr(func, "__name__", ""), tuple(args), dict(kwargs or {}))
        return func(*args, **kwargs)
