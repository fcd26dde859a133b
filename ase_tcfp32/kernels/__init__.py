"""GEMM backends for the emulated precisions.

Every backend has the same three methods, used by :class:`ase_tcfp32.layers.TCLinear`:

- ``prepare(weight [N, K]) -> prepared``: split the frozen weight once (on a GPU also
  tune its launch configuration, once per GPU and shape: :mod:`.autotune`);
- ``forward(x [M, K], prepared, bias [N] | None) -> y [M, N]``;
- ``grad_input(grad_y [M, N], prepared) -> grad_x [M, K]``.

:func:`get_backend` picks one from the device, following
:func:`ase_tcfp32.precision.support`.
"""

from __future__ import annotations

import functools

import torch

from ..precision import support
from .reference import SCHEMES, ReferenceBackend, emulated_mm
from .split import round_tf32, split_bf16x3, split_tf32, truncate_tf32

__all__ = [
    "SCHEMES",
    "ReferenceBackend",
    "emulated_mm",
    "get_backend",
    "round_tf32",
    "split_bf16x3",
    "split_tf32",
    "truncate_tf32",
]


@functools.lru_cache(maxsize=None)
def get_backend(precision: str, device: torch.device, emulate: str | None = None):
    """The backend that computes ``precision`` on ``device``, or the tensor-core model of
    GPU ``emulate`` (on CPU) when given."""
    if emulate is not None:
        from ..tcmodel import TCModelBackend

        return TCModelBackend(precision, emulate)
    backend = support(precision, device).backend
    if backend == "reference":
        return ReferenceBackend(precision)
    if backend == "triton":
        from .triton_gemm import TritonBackend

        return TritonBackend(precision)
    if backend == "gluon":
        from .fp16x3 import Fp16x3Backend

        return Fp16x3Backend()
    if backend == "cuBLAS BF16x9":
        from .cublas import CublasBF16x9Backend

        return CublasBF16x9Backend()
    raise RuntimeError(f"precision {precision!r} has no backend on {device}")
