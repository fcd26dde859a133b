"""What a GEMM kernel can do to its output tile before writing it: PET's activations.

``y = act(x @ w^T + bias + residual)`` in one pass, with ``act`` one of
:data:`ACTIVATIONS`: nothing, SiLU (``z sigmoid(z)``: the compression, the message
combination and the heads) or SwiGLU (``v sigmoid(g)``: the transformer's
feed-forwards). For SwiGLU the weight's rows are interleaved (:func:`interleave`), value
row i next to gate row i, so that every output tile holds matching pairs side by side
and the kernel writes ``h`` [M, F] instead of ``[v | g]`` [M, 2F].

SiLU is ``z / (1 + exp(-z))`` and SwiGLU ``v * (1 / (1 + exp(-g)))``, as torch and our
SwiGLU kernel compute them, with libdevice's ``exp`` (CUDA's ``expf``: at most 2 units in
the last place); Triton's approximate
``tl.exp`` (``ex2`` of ``z log2(e)``) would lose ``|z| 2^-24`` of relative accuracy in
rounding its argument. Written twice, once for Triton's and once for Gluon's front end
(their ``jit`` functions do not call each other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon.language.extra import libdevice as gl_libdevice
from triton.language.extra import libdevice

from .context import INTERPRETED

_INTERPRETED = tl.constexpr(INTERPRETED)

ACTIVATIONS = {None: 0, "silu": 1, "swiglu": 2}
"""Activation names and the kernels' ``ACTIVATION`` codes."""


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


@gluon.jit
def gl_silu(z):
    """SiLU as :func:`apply` computes it, in Gluon."""
    return z / (1.0 + gl_libdevice.exp(-z))


@gluon.jit
def gl_swiglu(value, gate):
    """SwiGLU as :func:`apply` computes it, in Gluon."""
    return value * (1.0 / (1.0 + gl_libdevice.exp(-gate)))


def interleave(weight: torch.Tensor) -> torch.Tensor:
    """A SwiGLU input projection's weight [2F, K] (or bias [2F]), value rows then gate rows
    as metatrain stores them, with its rows interleaved: value i, gate i, value i + 1..."""
    f = weight.shape[0] // 2
    return weight.reshape(2, f, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape).contiguous()


def activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """:func:`apply` in torch: the activation of ``z`` [M, N] (SwiGLU: [M, N // 2] from
    interleaved columns, value, gate, value...)."""
    if activation == "silu":
        return torch.nn.functional.silu(z)
    if activation == "swiglu":
        return z[:, 0::2] * torch.sigmoid(z[:, 1::2])
    return z
