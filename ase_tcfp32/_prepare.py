"""Model preparation: a metatrain PET made to compute in a precision, in place.

Every ``torch.nn.Linear`` becomes a :class:`ase_tcfp32.layers.TCLinear`; where our
tensor-core kernels serve the precision on the device, PET's attention, its SwiGLU
feed-forwards, its message combination, its edge-token compression and its PreLN transformer
layers get our subclasses (:mod:`ase_tcfp32._attention`, :mod:`ase_tcfp32._fused`,
:mod:`ase_tcfp32._folded`, :mod:`ase_tcfp32._table`);
optionally the GNN layers are recomputed in the backward pass and the tensor code compiled.
"""

from __future__ import annotations

import torch

from ._attention import on_tensor_cores, swap_attention_blocks
from ._compilation import compile_backend
from ._folded import swap_cartesian_transformers
from ._fused import swap_feed_forwards
from ._swapping import recompute_gnn_layers
from ._table import swap_backends, swap_transformer_layers
from .layers import swap_linear_layers


def prepare_model(
    pet: torch.nn.Module,
    precision: str,
    device: torch.device,
    *,
    emulate: str | None = None,
    check_accuracy: int = 0,
    low_memory: bool = False,
    compile: bool = False,
) -> bool:
    """Make metatrain ``pet`` compute its Linear layers in ``precision`` on ``device`` (or
    through the tensor-core model of GPU ``emulate``), in place, and return whether its
    attention, SwiGLU, message combination, edge compression and transformer layers' epilogues
    run on our kernels.

    :param check_accuracy: every this many calls, the accuracy watchdog checks each layer
        (:mod:`ase_tcfp32.watchdog`; 0: never).
    :param low_memory: recompute each GNN layer in the backward pass instead of storing its
        activations.
    :param compile: run PET's tensor code through ``torch.compile``.
    """
    swap_linear_layers(pet, precision, emulate=emulate, check_accuracy=check_accuracy)
    ours = emulate is None and on_tensor_cores(precision, device)
    swap_attention_blocks(pet, ours)
    swap_feed_forwards(pet, ours)  # where the attention is ours, so are the SwiGLU
    swap_backends(pet, ours)  # the message combination
    swap_cartesian_transformers(pet, ours)  # and the edge-token compression
    swap_transformer_layers(pet, ours)  # and the norms, SwiGLU and residuals on metatrain's table
    if low_memory:
        recompute_gnn_layers(pet)
    if compile:
        compile_backend(pet.backend)
    return ours
