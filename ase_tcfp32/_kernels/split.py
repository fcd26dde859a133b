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

``split_fp16x3(x) -> (hi, lo, down)`` is the fp16x3 split (``scale_rows`` then
``split_fp16``): each row scaled by the power of two ``2^a`` that brings its maximum magnitude into
[2^14, 2^15) (the top of FP16's range; ``down = 2^-a``), then ``hi`` = FP16 nearest-even
and ``lo`` = the remainder rounded to FP16. ``hi + lo`` is ``x * 2^a`` to 2^-23 relative
to each element; elements more than 2^17 below the row maximum keep less of ``lo``, but what they
lose is below 2^-38 of the row maximum.
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


def scale_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * 2^a, 2^-a)`` for FP32 ``x`` [R, K], with one power of two per row that puts
    the row's largest magnitude in [2^14, 2^15); ``a`` is clamped to [-126, 126] (zero,
    subnormal and Inf/NaN rows)."""
    amax = x.abs().amax(1) if x.shape[1] else x.new_zeros(x.shape[0])
    exponent = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    a = (141 - exponent).clamp(-126, 126)
    one = torch.ones_like(amax)
    return x * torch.ldexp(one, a)[:, None], torch.ldexp(one, -a)


def split_fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)``: FP16 ``hi`` (nearest even) of FP32 ``x`` within FP16's range, and the
    remainder ``lo`` rounded to FP16, as FP32 tensors; ``lo`` is 0 where ``x`` is Inf/NaN."""
    hi = x.half().float()
    rest = x - hi
    return hi, torch.where(torch.isnan(rest), 0.0, rest).half().float()


def split_fp16x3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hi, lo, down)`` of FP32 ``x`` [R, K]: the FP16 words (as FP32 tensors) of ``x``
    scaled per row by :func:`scale_rows`, and ``down`` [R] (``2^-a``) that undoes it."""
    scaled, down = scale_rows(x)
    return (*split_fp16(scaled), down)
