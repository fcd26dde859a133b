"""Our FP32-emulating GEMMs as a given GPU generation's tensor cores compute them.

The schemes follow the package's Triton kernels step by step: operands split with
:mod:`ase_tcfp32._kernels.split` (TF32 ``lo`` words truncated, as the hardware reads only
their top 19 bits), along K tiles of 32 columns; in each tile hi*hi chains through a
fresh tensor-core accumulator and joins the running sum with an IEEE FP32 addition, while
the small products (zero for Inf inputs) chain through one accumulator over all of K,
added at the end. Single-pass ``tf32`` is one chain over all of K. ``fp16x3`` follows the
Gluon kernel (:mod:`ase_tcfp32._kernels.fp16x3`): the weight's rows scaled by powers of two
and split into FP16 words once, each 32-wide K-tile of x scaled per row and split, and
lo*w_hi, hi*w_lo, hi*w_hi chained through one fresh accumulator per K-tile that joins the
FP32 sum times the rows' ``2^-a``. Each chain runs the bit-accurate block FMA of ``gpu``.

On Blackwell the package runs BF16x9 through cuBLAS, whose internal order is not
published: there the preview shows what our Triton BF16x9 kernel would compute.
"""

from __future__ import annotations

import numpy as np
import torch

from .._kernels.reference import SCHEMES
from .._kernels.split import split_fp16x3
from .core import TILE_ELEMENTS, _chain, map_row_tiles
from .presets import TensorCore, tensor_core

BLOCK_K = 32
"""K-tile of the Triton kernels (``tile_config``)."""

_IN_FMT = {"tf32": "tf32", "tf32x3": "tf32", "fp16x3": "fp16", "bf16x9": "bf16"}
PRODUCTS = {"tf32": 1, "tf32x3": 3, "fp16x3": 3, "bf16x9": 9}
"""Tensor-core products per output element and K, for progress estimates."""


def _words(x: np.ndarray, precision: str) -> list[np.ndarray]:
    """Tensor-core words of FP32 values, as float64 arrays."""
    words = SCHEMES[precision].words(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    return [w.numpy().astype(np.float64) for w in words]


def _without_inf(words: list[np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """The words as the corrections use them: zero where ``x`` is infinite."""
    return [np.where(np.isinf(x), 0.0, word) for word in words]


def _fp16x3_matmul(x: np.ndarray, w: np.ndarray, params, progress=None) -> np.ndarray:
    """``x @ w.T`` as the fp16x3 kernel computes it with block FMAs of ``params``."""
    w_hi, w_lo, w_down = (word.numpy().astype(np.float64) for word in split_fp16x3(torch.from_numpy(w)))
    w_hi, w_lo = w_hi.T.copy(), w_lo.T.copy()  # [K, N]
    w_down = w_down.astype(np.float32)
    m, k = x.shape
    n = w.shape[0]

    def rows(r: slice) -> np.ndarray:
        zero = np.zeros((x[r].shape[0], n))
        acc = zero.astype(np.float32)
        for k0 in range(0, k, BLOCK_K):
            tile = slice(k0, k0 + BLOCK_K)
            hi, lo, down = split_fp16x3(torch.from_numpy(np.ascontiguousarray(x[r, tile])))
            hi, lo = hi.numpy().astype(np.float64), lo.numpy().astype(np.float64)
            hi_c = np.where(np.isinf(hi), 0.0, hi)
            block = _chain(lo, w_hi[tile], zero, params, "fp16", "fp32")
            block = _chain(hi_c, w_lo[tile], block, params, "fp16", "fp32")
            block = _chain(hi, w_hi[tile], block, params, "fp16", "fp32")
            acc = acc + block.astype(np.float32) * down.numpy()[:, None]  # exact scaling, one IEEE add
        return acc * w_down

    tile_rows = max(1, TILE_ELEMENTS // max(1, n * params.block))
    return map_row_tiles(rows, m, n, tile_rows, progress)


def emulated_matmul(
    x: np.ndarray, w: np.ndarray, precision: str, gpu: str | TensorCore = "H100", *, progress=None
) -> np.ndarray:
    """``x @ w.T`` (FP32 ``x`` [M, K], ``w`` [N, K]) in ``precision`` on ``gpu``, as float32."""
    params = tensor_core(gpu).params(_IN_FMT[precision])
    if precision == "fp16x3":
        x, w = (np.ascontiguousarray(a, dtype=np.float32) for a in (x, w))
        return _fp16x3_matmul(x, w, params, progress).astype(np.float32)
    scheme = SCHEMES[precision]
    fmt = _IN_FMT[precision]
    x_words = _words(x, precision)
    x_small = _without_inf(x_words, x)
    w_words = [word.T.copy() for word in _words(w, precision)]  # [K, N]
    m, k = x.shape
    n = w.shape[0]

    def rows(r: slice) -> np.ndarray:
        hi, xs = x_words[0][r], [word[r] for word in x_small]
        zero = np.zeros((hi.shape[0], n))
        if not scheme.small:
            return _chain(hi, w_words[0], zero, params, fmt, "fp32").astype(np.float32)
        acc, small = zero.astype(np.float32), zero
        for k0 in range(0, k, BLOCK_K):
            tile = slice(k0, k0 + BLOCK_K)
            block = _chain(hi[:, tile], w_words[0][tile], zero, params, fmt, "fp32")
            acc = acc + block.astype(np.float32)  # the FP32 running sum, IEEE round to nearest
            for i, j in scheme.small:
                small = _chain(xs[i][:, tile], w_words[j][tile], small, params, fmt, "fp32")
        return acc + small.astype(np.float32)

    tile_rows = max(1, TILE_ELEMENTS // max(1, n * params.block))
    return map_row_tiles(rows, m, n, tile_rows, progress).astype(np.float32)


class TCModelBackend:
    """The tensor-core model of ``gpu`` as a backend of the precision layer (CPU, slow)."""

    def __init__(self, precision: str, gpu: str | TensorCore):
        if precision not in _IN_FMT:
            raise ValueError(f"emulation models {', '.join(_IN_FMT)}, not {precision!r}")
        self.precision = precision
        self.gpu = tensor_core(gpu)
        self.name = f"tcmodel:{self.gpu.name}"

    def prepare(self, weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        w = weight.detach().cpu().float().numpy()
        return w, np.ascontiguousarray(w.T)

    def _run(self, x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
        m, n = x.shape[0], w.shape[0]
        work = m * n * x.shape[1] * PRODUCTS[self.precision]
        progress = None
        if work > 2e8:
            from tqdm.auto import tqdm

            bar = tqdm(total=m, desc=f"{self.name} {self.precision} {m}x{x.shape[1]}x{n}", unit="row", leave=False)
            progress = bar.update
        y = emulated_matmul(x.detach().cpu().numpy(), w, self.precision, self.gpu, progress=progress)
        if progress is not None:
            bar.close()
        return torch.from_numpy(y).to(x.device)

    def forward(self, x: torch.Tensor, prepared, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._run(x, prepared[0])
        return y if bias is None else y + bias

    def grad_input(self, grad_y: torch.Tensor, prepared) -> torch.Tensor:
        return self._run(grad_y, prepared[1])
