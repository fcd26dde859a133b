"""Reference emulation of the tensor-core GEMM schemes in plain torch (CPU or GPU).

Each FP32 operand becomes the words the tensor core sees (:data:`SCHEMES`); along K,
the GEMM walks blocks of ``block_k`` columns like the GPU kernels do. In each block
the hi*hi product is formed in a fresh FP32 accumulator and joins the running FP32 sum
with one IEEE addition; the small (correction) word products go into a second
accumulator that runs over all of K and is added at the end. The corrections of
Inf inputs are dropped (they would be NaN); NaN inputs keep theirs, so results carry
Inf/NaN like an FP32 matmul. Weights holding Inf/NaN are multiplied in plain FP32.

fp16x3 (:func:`emulated_fp16x3_mm`) scales each row of the weight once, and each row of
x per K-block, by a power of two, splits both into two FP16 words, and forms the three
word products of a K-block in one fresh accumulator that joins the FP32 sum scaled back.

The one way this differs from the hardware: a tensor core adds the products of a
k-chunk with its own fixed-point alignment and truncation (see ``ase_tcfp32.tcmodel``),
while here every product (exact in FP32) is summed with IEEE FP32 arithmetic. The
difference is at the level of FP32 rounding noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .split import round_tf32, split_bf16x3, split_fp16x3, split_tf32, truncate_tf32

Words = tuple[torch.Tensor, ...]


def _tf32_words(x: torch.Tensor) -> Words:
    return (round_tf32(x),)


def _tf32x3_words(x: torch.Tensor) -> Words:
    hi, lo = split_tf32(x)
    return hi, truncate_tf32(lo)  # a TF32 unit reads only the top 19 bits of lo


@dataclass(frozen=True)
class Scheme:
    """How a precision forms a product: its operand words and word products.

    ``small`` lists the (x word, w word) correction products, in the order in which
    each K-block adds them to the corrections' running sum.
    """

    name: str
    words: Callable[[torch.Tensor], Words]
    small: tuple[tuple[int, int], ...]


SCHEMES = {
    "tf32": Scheme("tf32", _tf32_words, ()),
    "tf32x3": Scheme("tf32x3", _tf32x3_words, ((1, 0), (0, 1))),
    "bf16x9": Scheme(
        "bf16x9",
        split_bf16x3,
        ((2, 2), (2, 1), (1, 2), (2, 0), (1, 1), (0, 2), (1, 0), (0, 1)),
    ),
}


def emulated_mm(x: torch.Tensor, w_words: Words, scheme: Scheme, block_k: int = 32) -> torch.Tensor:
    """``x @ w.T`` for FP32 ``x`` [M, K] and the words of ``w`` [N, K], as [M, N]."""
    x_words = scheme.words(x)
    infinite = torch.isinf(x)
    x_small = [torch.where(infinite, 0.0, word) for word in x_words] if scheme.small else []
    m, k = x.shape
    out = x.new_zeros(m, w_words[0].shape[0])
    small = torch.zeros_like(out)
    for k0 in range(0, k, block_k):
        cols = slice(k0, k0 + block_k)
        out += x_words[0][:, cols] @ w_words[0][:, cols].T
        for i, j in scheme.small:
            small.addmm_(x_small[i][:, cols], w_words[j][:, cols].T)
    return out + small if scheme.small else out


def emulated_fp16x3_mm(x: torch.Tensor, w_words: Words, block_k: int = 32) -> torch.Tensor:
    """``x @ w.T`` in fp16x3 for FP32 ``x`` [M, K] and :func:`split_fp16x3` of ``w``."""
    w_hi, w_lo, w_down = w_words
    out = x.new_zeros(x.shape[0], w_hi.shape[0])
    for k0 in range(0, x.shape[1], block_k):
        cols = slice(k0, k0 + block_k)
        hi, lo, down = split_fp16x3(x[:, cols])
        hi_c = torch.where(torch.isinf(hi), 0.0, hi)  # Inf inputs drop their corrections
        tile = lo @ w_hi[:, cols].T + hi_c @ w_lo[:, cols].T + hi @ w_hi[:, cols].T
        out += tile * down[:, None]
    return out * w_down


class SplitWeight(NamedTuple):
    """A weight [N, K] and the words of it and of its transpose."""

    weight: torch.Tensor
    forward: Words | None
    backward: Words | None


class ReferenceBackend:
    """The torch emulation of one scheme, with the layer interface of every backend."""

    name = "reference"

    def __init__(self, precision: str):
        if precision == "fp16x3":
            self.words, self.mm = split_fp16x3, emulated_fp16x3_mm
        else:
            scheme = SCHEMES[precision]
            self.words, self.mm = scheme.words, lambda x, words: emulated_mm(x, words, scheme)

    def prepare(self, weight: torch.Tensor) -> SplitWeight:
        """Words of ``weight`` [N, K] for the forward and of its transpose for dX (none
        when it holds Inf/NaN: then the products are plain FP32)."""
        weight = weight.detach()
        if not torch.isfinite(weight).all():
            return SplitWeight(weight, None, None)
        return SplitWeight(weight, self.words(weight), self.words(weight.T.contiguous()))

    def forward(self, x: torch.Tensor, prepared: SplitWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if prepared.forward is None:
            return torch.nn.functional.linear(x, prepared.weight, bias)
        y = self.mm(x, prepared.forward)
        return y if bias is None else y + bias

    def grad_input(self, grad_y: torch.Tensor, prepared: SplitWeight) -> torch.Tensor:
        if prepared.backward is None:
            return grad_y @ prepared.weight
        return self.mm(grad_y, prepared.backward)
