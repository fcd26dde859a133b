"""What a GEMM kernel can do to its output tile before writing it: PET's activations,
residuals and folded edge embeddings.

``y = act(x @ w^T + bias + residual)`` in one pass, with ``act`` one of
:data:`ACTIVATIONS`: nothing, SiLU (``z sigmoid(z)``: the compression, the message
combination and the heads) or SwiGLU (``v sigmoid(g)``: the transformer's
feed-forwards). For SwiGLU the weight's rows are interleaved (:func:`interleave`), value
row i next to gate row i, so that every output tile holds matching pairs side by side
and the kernel writes ``h`` [M, F] instead of ``[v | g]`` [M, 2F]. The residual is a
tensor the kernel reads, or an :class:`Embedding` it computes (:func:`embedding`). The
kernels can also divide each row of the product by its input row's RMS (an RMS norm
before the layer, its weight multiplied into ``w``: ``rms_eps`` of their launchers).

For a backward pass the kernels can also write the pre-activation ``z`` that a forward tile
held (``KEEP``; SwiGLU's interleaved pairs go back to metatrain's ``[v | g]`` columns),
besides ``h``: the activation's own pass over ``z`` is then not needed.

SiLU is ``z / (1 + exp(-z))`` and SwiGLU ``v * (1 / (1 + exp(-g)))``, as torch and our
SwiGLU kernel compute them, with libdevice's ``exp`` (CUDA's ``expf``: at most 2 units in
the last place); Triton's approximate ``tl.exp`` (``ex2`` of ``z log2(e)``) would lose
``|z| 2^-24`` of relative accuracy in rounding its argument. Written twice, once for
Triton's and once for Gluon's front end (their ``jit`` functions do not call each other)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice as gl_libdevice
from triton.language.extra import libdevice

from .context import INTERPRETED

_INTERPRETED = tl.constexpr(INTERPRETED)

ACTIVATIONS = {None: 0, "silu": 1, "swiglu": 2}
"""Activation names and the kernels' ``ACTIVATION`` codes."""


class Embedding(NamedTuple):
    """A residual the epilogue computes instead of reading: ``table[index] + geometry @
    matrix^T`` [M, N] (PET's edge embeddings folded into its compression,
    :mod:`ase_tcfp32._folded`: a per-species row plus a K = 4 product on each pair's
    vector and length)."""

    table: torch.Tensor  # [T, N]
    index: torch.Tensor  # [M] int64, rows of table
    geometry: torch.Tensor  # [M, 4]
    matrix: torch.Tensor  # [N, 4]

    def tensor(self) -> torch.Tensor:
        """The residual itself, [M, N], as torch computes it."""
        return torch.addmm(self.table[self.index], self.geometry, self.matrix.T)


@triton.jit
def embedding(acc, rows, cols, M, N, table_ptr, index_ptr, geometry_ptr, matrix_ptr):
    """``acc + table[index[rows]] + geometry[rows] @ matrix^T`` for an output tile (see
    :class:`Embedding`; rows int64, columns in [0, N))."""
    inside_rows, inside_cols = rows < M, cols < N
    index = tl.load(index_ptr + rows, mask=inside_rows, other=0)
    inside = inside_rows[:, None] & inside_cols[None, :]
    acc += tl.load(table_ptr + index[:, None] * N + cols[None, :], mask=inside, other=0.0)
    for j in tl.static_range(4):
        g = tl.load(geometry_ptr + rows * 4 + j, mask=inside_rows, other=0.0)
        acc += g[:, None] * tl.load(matrix_ptr + cols * 4 + j, mask=inside_cols, other=0.0)[None, :]
    return acc


@triton.jit
def _exp(z):
    """CUDA's ``expf`` (see the module doc)."""
    if _INTERPRETED:  # no libdevice there
        return tl.exp(z)
    else:
        return libdevice.exp(z)


@triton.jit
def apply(acc, ACTIVATION: tl.constexpr):
    """The activation of an output tile [BM, BN] (SwiGLU: [BM, BN // 2] from interleaved pairs)."""
    if ACTIVATION == 1:  # z / (1 + exp(-z)), as torch: z * sigmoid(z) would flush near z = -88
        return acc / (1.0 + _exp(-acc))
    elif ACTIVATION == 2:
        value, gate = tl.split(tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))
        return value * (1.0 / (1.0 + _exp(-gate)))
    else:
        return acc


@triton.jit
def keep(acc, rows, col0, M, N, saved_ptr, stride_s, ACTIVATION: tl.constexpr):
    """Write an output tile's pre-activation ``acc`` [BM, BN] (columns from ``col0``) to
    ``saved`` [M, N]; SwiGLU's interleaved pairs as ``[v | g]`` (value j at column j,
    gate j at N / 2 + j)."""
    if ACTIVATION == 2:
        value, gate = tl.split(tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))
        cols = col0 // 2 + tl.arange(0, acc.shape[1] // 2)
        inside = (rows[:, None] < M) & (cols[None, :] < N // 2)
        at = saved_ptr + rows[:, None] * stride_s + cols[None, :]
        tl.store(at, value, mask=inside)
        tl.store(at + N // 2, gate, mask=inside)
    else:
        cols = col0 + tl.arange(0, acc.shape[1])
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(saved_ptr + rows[:, None] * stride_s + cols[None, :], acc, mask=inside)


@gluon.jit
def gl_silu(z):
    """SiLU as :func:`apply` computes it, in Gluon."""
    return z / (1.0 + gl_libdevice.exp(-z))


@gluon.jit
def gl_swiglu(value, gate):
    """SwiGLU as :func:`apply` computes it, in Gluon."""
    return value * (1.0 / (1.0 + gl_libdevice.exp(-gate)))


@gluon.jit
def gl_embedding(acc, rows, cols, M, N, table_ptr, index_ptr, geometry_ptr, matrix_ptr):
    """:func:`embedding` in Gluon (``rows``, ``cols`` in the slices of ``acc``'s layout)."""
    inside_rows, inside_cols = rows < M, cols < N
    index = gl.load(index_ptr + rows, mask=inside_rows, other=0)
    inside = gl.expand_dims(inside_rows, 1) & gl.expand_dims(inside_cols, 0)
    at = gl.expand_dims(index * N, 1) + gl.expand_dims(cols, 0)
    acc = acc + gl.load(table_ptr + at, mask=inside, other=0.0)
    for j in gl.static_range(4):
        g = gl.load(geometry_ptr + rows * 4 + j, mask=inside_rows, other=0.0)
        c = gl.load(matrix_ptr + cols * 4 + j, mask=inside_cols, other=0.0)
        acc = acc + gl.expand_dims(g, 1) * gl.expand_dims(c, 0)
    return acc


def interleave(weight: torch.Tensor) -> torch.Tensor:
    """A SwiGLU input projection's weight [2F, K] (or bias [2F]), value rows then gate rows
    as metatrain stores them, with its rows interleaved: value i, gate i, value i + 1..."""
    f = weight.shape[0] // 2
    return weight.reshape(2, f, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape).contiguous()


def without_product(
    m: int,
    n: int,
    device: torch.device,
    bias,
    residual: torch.Tensor | Embedding | None,
    activation: str | None,
    keep: bool = False,
):
    """What a kernel gives for K = 0, where ``x @ w^T`` is zeros [m, n]: ``act(bias +
    residual)``, with ``keep`` also the pre-activation (a pair ``(y, z)``)."""
    if isinstance(residual, Embedding):
        residual = residual.tensor()
    z = torch.zeros((m, n), device=device) + (0.0 if bias is None else bias)
    z = z + (0.0 if residual is None else residual)
    return (activate(z, activation), z) if keep else activate(z, activation)


def activation_grad(grad_h: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient by the pre-activation ``z`` [M, N] (SwiGLU: ``[v | g]`` [M, 2F], ``grad_h``
    [M, F]) of the ``activation``, given the output's ``grad_h``: torch's ``silu_backward``,
    and for SwiGLU :mod:`.swiglu`'s one-pass kernel on the GPU (torch's steps elsewhere)."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad_h, z)
    if z.is_cuda and z.dtype == torch.float32:
        from . import swiglu

        return swiglu.backward(grad_h, z.contiguous())
    v, g = z.chunk(2, dim=-1)
    s = torch.sigmoid(g)
    return torch.cat([grad_h * s, (grad_h * v) * (1.0 - s) * s], dim=-1)


def activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """:func:`apply` in torch: the activation of ``z`` [M, N] (SwiGLU: [M, N // 2] from
    interleaved columns, value, gate, value...)."""
    if activation == "silu":
        return torch.nn.functional.silu(z)
    if activation == "swiglu":
        return z[:, 0::2] * torch.sigmoid(z[:, 1::2])
    return z
