"""Splitting FP32 operands into tensor-core words, shared by every backend.

``split_tf32(x) -> (hi, lo)``: ``hi`` is ``x`` rounded to TF32 (10 fraction bits) to
nearest with ties away from zero, the ``cvt.rna.tf32.f32`` rule; ``lo = x - hi`` is
exact in FP32. ``split_bf16x3(x) -> (hi, mid, lo)``: three round-to-nearest-even
BF16 words whose sum is ``x`` exactly for normal FP32 numbers down to about 2^-110.

All words are returned as FP32 tensors (a TF32 or BF16 value is an FP32 value with
trailing zero bits), so any FP32 GEMM can consume them. Rounding that overflows a
finite ``x`` to infinity falls back to truncation, so finite inputs never produce
infinite words. Inf and NaN inputs give an Inf/NaN ``hi`` and NaN lower words; the
GEMMs drop NaN corrections so that results propagate Inf/NaN like an FP32 matmul.
"""

from __future__ import annotations

import torch

_TF32_DROP = 0x1FFF  # the 13 low fraction bits that TF32 lacks
_TF32_HALF = 0x1000


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its 13 low fraction bits cleared (round toward zero to TF32)."""
    return _from_bits(x.contiguous().view(torch.int32) & ~_TF32_DROP)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32, nearest with ties away from zero (``cvt.rna``)."""
    x = x.contiguous()
    rounded = _from_bits((x.view(torch.int32) + _TF32_HALF) & ~_TF32_DROP)
    overflow = torch.isinf(rounded) & torch.isfinite(x)
    rounded = torch.where(overflow, truncate_tf32(x), rounded)
    return torch.where(torch.isnan(x), x, rounded)


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 ``x`` into ``(hi, lo)``: TF32 ``hi`` and the exact remainder ``lo``."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_tf32 needs float32, got {x.dtype}")
    hi = round_tf32(x)
    return hi, x - hi


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    rounded = x.to(torch.bfloat16).to(torch.float32)
    overflow = torch.isinf(rounded) & torch.isfinite(x)
    truncated = _from_bits(x.contiguous().view(torch.int32) & ~0xFFFF)
    return torch.where(overflow, truncated, rounded)


def split_bf16x3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split FP32 ``x`` into three BF16 words ``(hi, mid, lo)`` with ``hi + mid + lo == x``."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_bf16x3 needs float32, got {x.dtype}")
    hi = _round_bf16(x)
    rest = x - hi
    mid = _round_bf16(rest)
    lo = _round_bf16(rest - mid)
    return hi, mid, lo
