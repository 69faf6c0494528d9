"""Lesson 7, the rest of the toolbox: the optimizer step in backward, a chunked loss, activation
offloading and lean optimizers, one module each."""

from course_lib.toolbox.activation_offload import HostOffload, transfer_seconds
from course_lib.toolbox.chunked_loss import (
    chunked_causal_lm_loss,
    chunked_cross_entropy,
    hidden_states_and_head,
    shifted_labels,
)
from course_lib.toolbox.lean_optimizers import (
    LEAN_OPTIMIZERS,
    StateTensor,
    bytes_per_parameter,
    embeddings_in_32_bits,
    state_tensors,
    stepped_optimizer,
)
from course_lib.toolbox.optimizer_in_backward import OptimizerInBackward, accumulation_breaks, clipping_breaks

__all__ = [
    "HostOffload",
    "transfer_seconds",
    "chunked_causal_lm_loss",
    "chunked_cross_entropy",
    "hidden_states_and_head",
    "shifted_labels",
    "LEAN_OPTIMIZERS",
    "StateTensor",
    "bytes_per_parameter",
    "embeddings_in_32_bits",
    "state_tensors",
    "stepped_optimizer",
    "OptimizerInBackward",
    "accumulation_breaks",
    "clipping_breaks",
]
