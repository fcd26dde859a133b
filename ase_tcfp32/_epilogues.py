"""Linear layers fused with what precedes and follows them: ``act(norm(x) @ W^T + b + r)`` in one GEMM.

Between PET's GEMMs run passes over memory that a GEMM could do while its operands or its
output tile are in registers (:mod:`ase_tcfp32._kernels.epilogue`): the RMS norms before
the attention's and the feed-forwards' input projections, the residual additions of the
transformer layers and of the message combination, the compression's folded edge
embeddings (a per-species row and a K = 4 product, :mod:`ase_tcfp32._folded`), the SiLU
of the compression, the combination and the heads, and the SwiGLU of the feed-forwards.
At 17,280 water atoms with PET-S each such pass reads or writes 0.5-2.3 GB. :func:`linear`
runs them in the layer's own kernel where it can:

- a residual, in every evaluation: its gradient is the output's, so backward is the
  layer's input gradient and nothing else (:class:`_Residual`);
- an activation between two layers, with gradients (:func:`pair`): the first layer's
  kernel writes ``h`` and keeps its pre-activation ``z`` for the backward pass (stored by
  TMA like ``h``), so the activation's forward pass over ``z`` does not run (:class:`_Pair`);
  the compression's folded embeddings are computed in that kernel too, and their backward
  (SiLU's gradient and the K = 4 product's) is one pass (:mod:`ase_tcfp32._kernels.folded`);
- an activation, the folded embeddings and an RMS norm before the layer, where no
  gradient is asked for (energy-only calls, direct forces, the inner steps of multiple
  time stepping): the layer then writes ``h`` only, not the pre-activation that a
  backward pass would need, and reads x once, summing its squares while it splits it.
  The norm's weight is multiplied into the layer's columns and the rows' ``1 /
  sqrt(mean(x^2) + eps)`` into the product; SwiGLU reads the layer's weight with its
  value and gate rows interleaved (both split once per weight, :func:`_derived`).

Everywhere else (CPU, cuBLAS FP32 for small GEMMs, the tensor-core model, ``fp32``,
``torch.compile``, trainable weights, gradients through a norm or an activation, a
LayerNorm) the same steps run one after another, as metatrain writes them. A call the
accuracy watchdog is due to check runs composed too, so the check sees the plain GEMM
(:func:`ase_tcfp32.watchdog.due`)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from . import watchdog
from ._backends import get_backend
from ._fused import frozen_rms_norm, rms_eps, swiglu
from ._kernels import folded
from ._kernels.context import INTERPRETED
from ._kernels.epilogue import Embedding, activation_grad
from .layers import TCLinear, _grad_input

_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per layer, per norm before it: (key, split weight, bias) with the norm's weight folded
in and, for SwiGLU, the value and gate rows interleaved."""

_state = threading.local()


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Run every :func:`linear` in this block step by step (benchmarks and tests compare)."""
    saved = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = saved


def _composed(layer: torch.nn.Module, x: torch.Tensor, residual, activation, norm) -> torch.Tensor:
    z = layer(x if norm is None else norm(x))
    if residual is not None:
        z = z + (residual.tensor().reshape(z.shape) if isinstance(residual, Embedding) else residual)
    return _activated(z, activation)


def _activated(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``activation`` (None, ``"silu"`` or ``"swiglu"`` of metatrain's ``[v | g]``) of ``z``, as
    the layers compute it unfused."""
    if activation == "silu":
        return torch.nn.functional.silu(z)
    return swiglu(z) if activation == "swiglu" else z


def _kernel_backend(layer: torch.nn.Module, x: torch.Tensor):
    """The backend that fuses ``layer``'s epilogues for ``x``, or None."""
    if getattr(_state, "off", False) or not isinstance(layer, TCLinear) or layer.weight.requires_grad:
        return None
    if torch.compiler.is_compiling():
        return None
    if x.dtype != torch.float32 or not (x.is_cuda or INTERPRETED) or layer.emulate is not None:
        return None
    backend = get_backend(layer.precision, x.device, None)
    return backend if hasattr(backend, "fused") else None


def _derived(layer: TCLinear, backend, device: torch.device, norm, interleaved: bool) -> tuple:
    """``layer``'s weight split by ``backend`` and its bias, with the ``norm``'s weight
    multiplied into its columns (in float64, rounded once) and, ``interleaved``, its value
    and gate rows interleaved (:func:`ase_tcfp32._kernels.epilogue.interleave`)."""
    from ._kernels.epilogue import interleave

    w, b, g = layer.weight, layer.bias, None if norm is None else norm.weight
    key = (layer.precision, device, interleaved) + tuple(
        None if t is None else (t.data_ptr(), t._version) for t in (w, b, g)
    )
    cached = _DERIVED.setdefault(layer, {})
    if cached.get(id(norm), (None,))[0] != key:
        weight = w.detach().to(device)
        if g is not None:
            weight = (weight.double() * g.detach().to(device).double()).float()
        bias = None if b is None else b.detach().to(device)
        if interleaved:
            weight, bias = interleave(weight), None if bias is None else interleave(bias)
        cached[id(norm)] = (key, backend.prepare(weight), bias)
    return cached[id(norm)][1:]


class _Residual(torch.autograd.Function):
    """``x @ W^T + b + residual`` in one kernel; backward: the layer's input gradient, and
    the output's gradient for the residual."""

    @staticmethod
    def forward(ctx, x, residual, layer, backend, prepared, bias):
        ctx.layer, ctx.split = layer, (backend, prepared, layer)
        y = backend.fused(x, prepared, bias, residual)
        return backend.forward(x, prepared, bias) + residual if y is None else y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        grad_y = grad_y.contiguous()
        grad_x = _grad_input(*ctx.split, grad_y, ctx.layer.weight) if ctx.needs_input_grad[0] else None
        return grad_x, grad_y, None, None, None, None


def linear(
    layer: torch.nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | Embedding | None = None,
    activation: str | None = None,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``activation(layer(norm(x)) + residual)`` for a Linear ``layer``, ``x`` [..., K] and
    ``residual`` [..., N] (or an :class:`~ase_tcfp32._kernels.epilogue.Embedding` of that
    many rows, which the kernel computes instead of reading); ``activation`` None, ``"silu"`` or ``"swiglu"`` (metatrain's
    ``v * sigmoid(g)`` of the output's halves ``[v | g]``: [..., N / 2]), ``norm`` a module
    applied to ``x`` first. One kernel where the layer's backend fuses it (see the module
    doc), else the steps one by one."""
    backend = _kernel_backend(layer, x)
    if isinstance(residual, Embedding) and (backend is None or torch.is_grad_enabled()):
        residual = residual.tensor().reshape(*x.shape[:-1], -1)  # computed in a kernel only without gradients
    grad = torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad))
    if norm is not None and (grad or backend is None or not frozen_rms_norm(norm, x)):
        x, norm = norm(x), None  # a norm with gradients, or one the kernels do not fold, runs on its own
    if backend is None or (grad and (activation is not None or residual is None)) or watchdog.due(layer, "forward"):
        return _composed(layer, x, residual, activation, norm)
    shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(residual, torch.Tensor):
        residual = residual.reshape(x.shape[0], -1).contiguous()
    if activation == "swiglu" or norm is not None:
        prepared, bias = _derived(layer, backend, x.device, norm, activation == "swiglu")
    else:
        prepared, bias = layer.prepared_weight(x.device), layer.bias
    if grad:  # a residual alone (see above)
        y = _Residual.apply(x, residual, layer, backend, prepared, bias)
        watchdog.count_call(layer, "forward")
    else:
        eps = None if norm is None else rms_eps(norm, x.dtype)
        y = backend.fused(x, prepared, bias, residual, activation, eps)
        if y is None:  # too few rows for the kernel
            y = _composed(layer, x, residual, activation, norm)
        else:
            watchdog.count_call(layer, "forward")
    return y.reshape(*shape, y.shape[-1])


class _Pair(torch.autograd.Function):
    """``second(act(first(x) + inner)) + residual`` (``inner``, ``residual`` tensors or None;
    with ``fold``, the ``(table, index, matrix)`` of an :class:`~ase_tcfp32._kernels.epilogue.Embedding`
    whose ``geometry`` is the fourth input, ``inner`` then None): forward, the first layer's
    kernel writes ``h`` and keeps the pre-activation ``z`` (the activation's own pass is not
    run; a folded embedding computed in its epilogue, not read), the second adds the
    residual; backward, the second layer's input gradient, the activation's (one pass over
    ``z``, with the geometry's gradient for a folded embedding: :mod:`ase_tcfp32._kernels.folded`)
    and the first layer's. Where a kernel declines (too few rows), that step runs unfused,
    with the same result."""

    @staticmethod
    def forward(ctx, x, inner, residual, geometry, first, second, backend, activation, fold):
        device = x.device
        if activation == "swiglu":
            prepared, bias = _derived(first, backend, device, None, True)
        else:
            prepared, bias = first.prepared_weight(device), first.bias
        if fold is not None:
            table, index, matrix = fold
            inner = Embedding(table, index, geometry, matrix)
        out = backend.fused(x, prepared, bias, inner, activation, keep=True)
        if out is None:
            inner = inner.tensor() if isinstance(inner, Embedding) else inner
            z = first(x) if inner is None else first(x) + inner
            h = _activated(z, activation)
        else:
            (h, z), _ = out, watchdog.count_call(first, "forward")
        y = None if residual is None else backend.fused(h, second.prepared_weight(device), second.bias, residual)
        if y is None:
            y = second(h) if residual is None else second(h) + residual
        else:
            watchdog.count_call(second, "forward")
        ctx.save_for_backward(z)
        ctx.layers, ctx.backend, ctx.activation = (first, second), backend, activation
        ctx.matrix = None if fold is None else fold[2]
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        (z,) = ctx.saved_tensors
        (first, second), backend, matrix = ctx.layers, ctx.backend, ctx.matrix
        needs = ctx.needs_input_grad
        grad_y = grad_y.contiguous()
        grad_h = _grad_input(backend, second.prepared_weight(grad_y.device), second, grad_y, second.weight)
        grad_geometry = None
        if matrix is not None and needs[3] and ctx.activation == "silu":
            grad_z, grad_geometry = folded.backward(grad_h, z, matrix)
        else:
            grad_z = activation_grad(grad_h, z, ctx.activation)
            if matrix is not None and needs[3]:
                grad_geometry = grad_z @ matrix
        grad_x = None
        if needs[0]:
            grad_x = _grad_input(backend, first.prepared_weight(grad_y.device), first, grad_z, first.weight)
        grad_inner = grad_z if needs[1] else None
        return grad_x, grad_inner, grad_y if needs[2] else None, grad_geometry, None, None, None, None, None


def pair(
    first: torch.nn.Module,
    second: torch.nn.Module,
    x: torch.Tensor,
    activation: str,
    inner: torch.Tensor | Embedding | None = None,
    residual: torch.Tensor | None = None,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``second(act(first(norm(x)) + inner)) + residual``: two Linear layers with an
    ``activation`` (``"silu"`` or ``"swiglu"``) between them, through :func:`linear`, or,
    with gradients, :class:`_Pair` (the activation in the first layer's kernel, which also
    keeps the pre-activation for the backward pass, and computes a folded embedding
    ``inner`` there too)."""
    backend = _kernel_backend(first, x)
    embedded = isinstance(inner, Embedding)
    tensors = [t for t in (x, inner.geometry if embedded else inner, residual) if isinstance(t, torch.Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if (
        not grad
        or backend is None
        or _kernel_backend(second, x) is not backend
        or any(watchdog.due(layer, "forward") for layer in (first, second))
    ):
        if embedded and (grad or backend is None):
            inner = inner.tensor().reshape(*x.shape[:-1], -1)
        return linear(second, linear(first, x, inner, activation, norm), residual)
    if norm is not None:
        x = norm(x)
    shape = x.shape[:-1]
    fold, geometry = None, None
    if embedded:
        fold, geometry, inner = (inner.table, inner.index.reshape(-1), inner.matrix), inner.geometry, None
    flat = [None if t is None else t.reshape(-1, t.shape[-1]).contiguous() for t in (x, inner, residual, geometry)]
    y = _Pair.apply(*flat, first, second, backend, activation, fold)
    return y.reshape(*shape, y.shape[-1])


def feed_forward(
    mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None, norm: torch.nn.Module | None = None
) -> torch.Tensor:
    """``residual + mlp(norm(x))`` for metatrain's ``FeedForward`` ``mlp`` (SwiGLU or not),
    through :func:`pair` or :func:`linear`."""
    if mlp.is_swiglu:
        return pair(mlp.w_in, mlp.w_out, x, "swiglu", residual=residual, norm=norm)
    return linear(mlp.w_out, mlp.activation(linear(mlp.w_in, x, norm=norm)), residual)


def _is(layers: torch.nn.Module, *kinds: type) -> bool:
    """Whether ``layers`` is an ``nn.Sequential`` of modules of these ``kinds``."""
    return (
        isinstance(layers, torch.nn.Sequential)
        and len(layers) == len(kinds)
        and all(isinstance(module, kind) for module, kind in zip(layers, kinds))
    )


def combination(mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + mlp(x)`` for PET's message-combination MLP ``mlp`` (Linear, SiLU,
    Linear), through :func:`pair`."""
    if not _is(mlp, torch.nn.Linear, torch.nn.SiLU, torch.nn.Linear):
        return residual + mlp(x)
    return pair(mlp[0], mlp[2], x, "silu", residual=residual)


def head(layers: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A PET head ``layers`` (Linear, SiLU, Linear, SiLU) on ``x``, through :func:`linear`."""
    if not _is(layers, torch.nn.Linear, torch.nn.SiLU, torch.nn.Linear, torch.nn.SiLU):
        return layers(x)
    return linear(layers[2], linear(layers[0], x, activation="silu"), activation="silu")
