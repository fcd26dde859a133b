"""Which GEMM backend computes a precision on a device: our kernels, cuBLAS, the CPU
reference, or the tensor-core model of a named GPU (:mod:`ase_tcfp32.tcmodel`)."""

from __future__ import annotations

import functools

import torch

from ._kernels import GemmBackend, ReferenceBackend
from .precision import support


@functools.cache
def get_backend(precision: str, device: torch.device, emulate: str | None = None) -> GemmBackend:
    """The backend that computes ``precision`` on ``device``, or the tensor-core model of
    GPU ``emulate`` (on CPU) when given."""
    if emulate is not None:
        from .tcmodel import TCModelBackend

        return TCModelBackend(precision, emulate)
    backend = support(precision, device).backend
    if backend == "reference":
        return ReferenceBackend(precision)
    if backend == "triton":
        from ._kernels.triton_gemm import TritonBackend

        return TritonBackend(precision)
    if backend == "gluon":
        from ._kernels.fp16x3 import Fp16x3Backend

        return Fp16x3Backend()
    if backend == "cuBLAS BF16x9":
        from ._kernels.cublas import CublasBF16x9Backend

        return CublasBF16x9Backend()
    raise RuntimeError(f"precision {precision!r} has no backend on {device}")
