"""Reference emulation of the tensor-core GEMM schemes in plain torch (CPU or GPU).

Each FP32 operand becomes the words the tensor core sees (:data:`SCHEMES`); along K,
the GEMM walks blocks of ``block_k`` columns like the GPU kernels do. In each block
the small word products go into a fresh FP32 accumulator (NaN corrections dropped,
as Inf inputs make them), the hi*hi product is added on top of that, and the block
result joins the running FP32 sum with one IEEE addition.

The one way this differs from the hardware: a tensor core adds the products of a
k-chunk with its own fixed-point alignment and truncation (see ``ase_tcfp32.tcmodel``),
while here every product (exact in FP32) is summed with IEEE FP32 arithmetic. The
difference is at the level of FP32 rounding noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .split import round_tf32, split_bf16x3, split_tf32, truncate_tf32

Words = tuple[torch.Tensor, ...]


def _tf32_words(x: torch.Tensor) -> Words:
    return (round_tf32(x),)


def _tf32x3_words(x: torch.Tensor) -> Words:
    hi, lo = split_tf32(x)
    return hi, truncate_tf32(lo)  # a TF32 unit reads only the top 19 bits of lo


@dataclass(frozen=True)
class Scheme:
    """How a precision forms a product: its operand words and word products.

    ``small`` lists the (x word, w word) products summed, in this order, in a fresh
    accumulator before the (0, 0) hi*hi product is added on top.
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
    m, k = x.shape
    out = x.new_zeros(m, w_words[0].shape[0])
    for k0 in range(0, k, block_k):
        xs = [word[:, k0 : k0 + block_k] for word in x_words]
        ws = [word[:, k0 : k0 + block_k] for word in w_words]
        block = torch.zeros_like(out)
        for i, j in scheme.small:
            block.addmm_(xs[i], ws[j].T)
        if scheme.small:
            block = torch.where(torch.isnan(block), 0.0, block)
        block.addmm_(xs[0], ws[0].T)
        out += block
    return out


class ReferenceBackend:
    """The torch emulation of one scheme, with the layer interface of every backend."""

    name = "reference"

    def __init__(self, precision: str):
        self.scheme = SCHEMES[precision]

    def prepare(self, weight: torch.Tensor) -> tuple[Words, Words]:
        """Words of ``weight`` [N, K] for the forward and of its transpose for dX."""
        weight = weight.detach()
        return self.scheme.words(weight), self.scheme.words(weight.T.contiguous())

    def forward(self, x: torch.Tensor, prepared: tuple[Words, Words], bias: torch.Tensor | None) -> torch.Tensor:
        y = emulated_mm(x, prepared[0], self.scheme)
        return y if bias is None else y + bias

    def grad_input(self, grad_y: torch.Tensor, prepared: tuple[Words, Words]) -> torch.Tensor:
        return emulated_mm(grad_y, prepared[1], self.scheme)
