"""Public API of the tensor-core model: one block (``mma``) and whole GEMMs (``matmul``)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .blockfma import block_fma, check_exact
from .presets import TensorCore, tensor_core

TILE_ELEMENTS = 1 << 15
"""Output elements per row tile: keeps the (block, rows, N) temporaries in cache."""


def mma(a, b, c=0.0, *, gpu: str | TensorCore = "H100", in_fmt: str = "fp16", out_fmt: str = "fp32") -> np.ndarray:
    """One block FMA ``d = c + sum_k a_k b_k`` per case, as the tensor core of ``gpu`` computes it.

    ``a``, ``b``: [..., K] with K <= the block size of ``in_fmt`` on ``gpu``; ``c``: [...]
    (fp32, or fp16 for ``out_fmt="fp16"``). Values must be exact in their formats.
    """
    params = tensor_core(gpu).params(in_fmt)
    a = check_exact(a, in_fmt, "a")
    b = check_exact(b, in_fmt, "b")
    c = check_exact(np.broadcast_to(np.asarray(c, dtype=np.float64), a.shape[:-1]), out_fmt, "c")
    if a.shape[-1] > params.block:
        raise ValueError(f"mma takes at most {params.block} products per case for {in_fmt}; use matmul for longer K")
    return block_fma(np.moveaxis(a, -1, 0), np.moveaxis(b, -1, 0), c, params, in_fmt, out_fmt)


def _chain(a: np.ndarray, b: np.ndarray, d: np.ndarray, params, in_fmt: str, out_fmt: str) -> np.ndarray:
    """``d`` [rows, N] after the blocks of a [rows, K] @ b [K, N], in increasing k."""
    k = a.shape[1]
    for k0 in range(0, k, params.block):
        a_blk = a[:, k0 : k0 + params.block].T[:, :, None]  # [L, rows, 1]
        b_blk = b[k0 : k0 + params.block][:, None, :]  # [L, 1, N]
        d = block_fma(a_blk, b_blk, d, params, in_fmt, out_fmt)
    return d


def matmul(
    A,
    B,
    C=None,
    *,
    gpu: str | TensorCore = "H100",
    in_fmt: str = "tf32",
    out_fmt: str = "fp32",
    check: bool = True,
    progress=None,
) -> np.ndarray:
    """``C + A @ B`` as one chain of tensor-core block FMAs along K (float64 result).

    ``A`` [M, K] and ``B`` [K, N] exact in ``in_fmt``; ``C`` [M, N] (default zeros).
    K is cut into blocks of the GPU's size in increasing k, each block's result is the
    next block's ``c`` (one accumulator, as an mma chain or a GEMM without split-K).
    Rows are processed in tiles across threads; ``progress`` is a callable given the
    number of rows done after each tile (e.g. a tqdm ``update``).
    """
    params = tensor_core(gpu).params(in_fmt)
    if check:
        A = check_exact(A, in_fmt, "A")
        B = check_exact(B, in_fmt, "B")
    A, B = np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64)
    (m, k), (k2, n) = A.shape, B.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: A is {A.shape}, B is {B.shape}")
    C = np.zeros((m, n)) if C is None else np.asarray(C, dtype=np.float64)
    if check:
        C = check_exact(C, out_fmt, "C")
    rows = max(1, TILE_ELEMENTS // max(1, n * params.block))
    return map_row_tiles(lambda r: _chain(A[r], B, C[r], params, in_fmt, out_fmt), m, n, rows, progress)


def map_row_tiles(fn, m: int, n: int, rows: int, progress=None) -> np.ndarray:
    """Concatenate ``fn(slice)`` [rows, n] over row tiles of an [m, n] result, in threads."""
    if m == 0 or n == 0:
        return np.zeros((m, n))
    slices = [slice(r0, min(m, r0 + rows)) for r0 in range(0, m, rows)]

    def run(rows_: slice) -> np.ndarray:
        out = fn(rows_)
        if progress is not None:
            progress(out.shape[0])
        return out

    with ThreadPoolExecutor(max_workers=min(len(slices), os.cpu_count() or 1)) as pool:
        return np.concatenate(list(pool.map(run, slices)), axis=0)
