"""GEMM, attention and fused kernels for the emulated precisions.

Every GEMM backend (:class:`GemmBackend`) serves :class:`ase_tcfp32.layers.TCLinear`;
:func:`ase_tcfp32._backends.get_backend` picks one from the device, following
:func:`ase_tcfp32.precision.support`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .reference import SCHEMES, ReferenceBackend, emulated_mm
from .split import round_tf32, split_bf16x3, split_tf32, truncate_tf32

__all__ = [
    "SCHEMES",
    "GemmBackend",
    "ReferenceBackend",
    "emulated_mm",
    "round_tf32",
    "split_bf16x3",
    "split_tf32",
    "truncate_tf32",
]


class GemmBackend(Protocol):
    """What :class:`ase_tcfp32.layers.TCLinear` asks of a GEMM backend (FP32 tensors). Our
    kernels' backends also offer ``fused(x, prepared, bias, residual, activation, rms_eps, keep)``,
    the product with its neighbours in one kernel (:mod:`.epilogue`, :mod:`ase_tcfp32._epilogues`),
    or None where they would not run their kernel."""

    def prepare(self, weight: torch.Tensor) -> Any:
        """Split the frozen ``weight`` [N, K] once (on a GPU also tune its launch
        configuration, once per GPU and shape: :mod:`.autotune`)."""

    def forward(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ weight.T + bias`` -> [M, N]."""

    def grad_input(self, grad_y: torch.Tensor, prepared: Any) -> torch.Tensor:
        """``grad_y [M, N] @ weight`` -> [M, K], the input's gradient."""
