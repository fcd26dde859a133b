"""PET's memory-bound stages in one kernel each way: the SwiGLU activation
(:func:`swiglu`, with the swap that puts it into a model) and the combination of messages
between GNN layers (:func:`combine_messages`).

metatrain's ``FeedForward`` with ``activation="SwiGLU"`` (every PET-MAD and uPET model)
computes ``w_out(v * sigmoid(g))`` with ``v, g = w_in(x).chunk(2, -1)``: six memory-bound
kernels per call, forward and backward, over PET's largest tensors (edge tokens times the
feed-forward width). :func:`swap_feed_forwards` turns every such module of a model into a
``FusedFeedForward`` (the same module, parameters and state_dict keys; only its class
changes) whose activation runs :mod:`ase_tcfp32._kernels.swiglu`: one pass forward, one
backward, with the same FP32 arithmetic.

Between GNN layers, metatrain's feed-forward featurizer normalises each message next to
its reverse pair's, ``LayerNorm(cat(o, o[reverse]))``: a gather, a ``cat``, the norm, and
backward the norm's gradient, a split and an ``index_add``, over tensors of edge tokens
times 2 d_pet. :func:`combine_messages` runs that step through
:mod:`ase_tcfp32._kernels.combination`: one pass forward, one backward (used on packed rows,
:mod:`ase_tcfp32._packed`, and on metatrain's table, :mod:`ase_tcfp32._table`).

Where one tensor feeds both a residual addition and an RMS norm (PET-MAD's PreLN
transformer layers, twice per layer), :func:`pre_norm` returns both from one function, so
that the backward pass adds the residual's gradient to the norm's in the norm's kernel
(:mod:`ase_tcfp32._kernels.rms_norm`) instead of in one more pass of autograd's.

The calculator swaps them where it runs PET's attention on tensor cores
(:func:`ase_tcfp32._attention.on_tensor_cores`): ``fp32`` and ``tf32`` keep metatrain's
code. Inside ``torch.compile`` and on CPU tensors (Triton's interpreter aside) both are
metatrain's expressions, which the compiler fuses itself.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._kernels.context import INTERPRETED
from ._swapping import lazy_subclass, swap_class


def _kernels():
    """:mod:`ase_tcfp32._kernels.swiglu`, imported on first use (Triton takes a while)."""
    from ._kernels import swiglu as kernels

    return kernels


def _combination_kernels():
    """:mod:`ase_tcfp32._kernels.combination`, imported on first use."""
    from ._kernels import combination

    return combination


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether our kernels take ``x``: float32 on CUDA (or on CPU under Triton's
    interpreter), outside ``torch.compile``."""
    return x.dtype == torch.float32 and not torch.compiler.is_compiling() and (x.is_cuda or INTERPRETED)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return _kernels().forward(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h):
        (y,) = ctx.saved_tensors
        return _kernels().backward(grad_h, y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``v * sigmoid(g)`` [..., F] for ``y = [v, g]`` [..., 2F] (PET's SwiGLU after its input
    projection), differentiable; one kernel each way for float32 CUDA tensors."""
    if not _on_kernels(y):
        v, g = y.chunk(2, dim=-1)
        return v * torch.sigmoid(g)
    return _SwiGLUFunction.apply(y.contiguous())


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """``FeedForward.forward`` with :func:`swiglu` as its activation."""
    if not self.is_swiglu:
        return super(type(self), self).forward(x)
    return self.w_out(swiglu(self.w_in(x)))


_classes, __getattr__ = lazy_subclass(
    __name__,
    "FusedFeedForward",
    "metatrain.pet.modules.transformer.FeedForward",
    forward=_forward,
    __doc__="metatrain's FeedForward with its SwiGLU in :func:`swiglu`.",
)
"""metatrain's ``FeedForward`` and ``FusedFeedForward``, our subclass (:func:`ase_tcfp32._swapping.lazy_subclass`)."""


def swap_feed_forwards(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Run the SwiGLU of every metatrain ``FeedForward`` in ``module`` through :func:`swiglu`
    (``enable=False``: back to metatrain's code); return their names. Idempotent;
    parameters and state_dict keys are unchanged."""
    return swap_class(module, *_classes(), enable, takes=lambda child: child.is_swiglu)


class _CombinationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, reverse, weight, bias, eps, residual):
        ctx.set_materialize_grads(False)
        y, mean, rstd, summed = _combination_kernels().forward(o, reverse, weight, bias, eps, residual)
        ctx.save_for_backward(o, reverse, weight, mean, rstd)
        return y if summed is None else (y, summed)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_summed=None):
        o, *rest = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros(*o.shape[:-1], 2 * o.shape[-1], dtype=o.dtype, device=o.device)
        grad_o = _combination_kernels().backward(grad_y, o, *rest, grad_summed)
        return grad_o, None, None, None, None, grad_summed


def featurizer_layers(backend: torch.nn.Module) -> zip:
    """metatrain's feed-forward featurizer GNN layer by GNN layer: for each, the combination's
    norm and MLP, the layer, and its node and edge post-message-passing modules (``PETBackend``'s
    module lists side by side)."""
    return zip(
        backend.combination_norms,
        backend.combination_mlps,
        backend.gnn_layers,
        backend.gnn_layers_post_mp_node,
        backend.gnn_layers_post_mp_edge,
        strict=True,
    )


def combine_messages(
    o: torch.Tensor, reverse: torch.Tensor, norm: torch.nn.LayerNorm, residual: torch.Tensor | None = None
):
    """``norm(cat([o, o[reverse]], -1))`` [N, J, 2D]: each of the messages ``o`` [N, J, D]
    next to its reverse pair's, ``reverse`` [N, J] being the flat slot (``j + J * i``) of
    slot (i, j)'s reverse and an involution (``reverse[reverse] == slots``: a padding slot
    is its own reverse); with ``residual`` [N, J, D] (the layer's input edges), also
    ``residual + o`` (returns both). Differentiable with respect to ``o`` and ``residual``;
    one kernel each way for float32 CUDA tensors and a frozen ``norm``."""
    if not _on_kernels(o) or norm.weight is None or norm.weight.requires_grad or norm.bias.requires_grad:
        reversed_messages = o.reshape(-1, o.shape[-1])[reverse.reshape(-1)].reshape(o.shape)
        y = norm(torch.cat([o, reversed_messages], dim=-1))
        return y if residual is None else (y, residual + o)
    if residual is not None:
        residual = residual.contiguous()
    return _CombinationFunction.apply(o.contiguous(), reverse.contiguous(), norm.weight, norm.bias, norm.eps, residual)


def _norm_kernels():
    """:mod:`ase_tcfp32._kernels.rms_norm`, imported on first use."""
    from ._kernels import rms_norm

    return rms_norm


class _PreNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.set_materialize_grads(False)
        y, rstd = _norm_kernels().forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return x, y  # x as it is: autograd hands its gradient to backward, not to an addition of its own

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_x, grad_y):
        x, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            return grad_x, None, None
        return _norm_kernels().backward(x, weight, rstd, grad_y, grad_x), None, None


def frozen_rms_norm(norm: torch.nn.Module | None, x: torch.Tensor) -> bool:
    """Whether ``norm`` is an RMS norm over the last dimension of ``x`` with no trainable
    weight (the kernels' norms: folded into a GEMM, or :func:`pre_norm`'s)."""
    return (
        isinstance(norm, torch.nn.RMSNorm)
        and tuple(norm.normalized_shape) == (x.shape[-1],)
        and (norm.weight is None or not norm.weight.requires_grad)
    )


def rms_eps(norm: torch.nn.RMSNorm, dtype: torch.dtype) -> float:
    """The ``eps`` an RMS norm adds to the mean square (torch's default: ``dtype``'s epsilon)."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def pre_norm(x: torch.Tensor, norm: torch.nn.Module) -> tuple:
    """``(residual, tokens, norm_left)`` for a layer that reads ``norm(x)`` next to a residual
    addition of ``x`` [..., d]: with gradients through a frozen RMS norm over d, ``x`` and
    ``norm(x)`` from :class:`_PreNormFunction` (one backward kernel for both uses) and no
    norm left; otherwise ``x``, ``x`` and ``norm`` (the layer applies it, or folds it into
    its GEMM: :func:`ase_tcfp32._epilogues.linear`)."""
    if not (
        torch.is_grad_enabled()
        and x.requires_grad
        and _on_kernels(x)
        and frozen_rms_norm(norm, x)
        and norm.weight is not None
    ):
        return x, x, norm
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    residual, tokens = _PreNormFunction.apply(flat, norm.weight, rms_eps(norm, x.dtype))
    return residual.reshape(x.shape), tokens.reshape(x.shape), None
