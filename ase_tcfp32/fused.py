"""PET's SwiGLU in one kernel each way: :func:`swiglu` and the feed-forward swap.

metatrain's ``FeedForward`` with ``activation="SwiGLU"`` (every PET-MAD and uPET model)
computes ``w_out(v * sigmoid(g))`` with ``v, g = w_in(x).chunk(2, -1)``: six memory-bound
kernels per call, forward and backward, over PET's largest tensors (edge tokens times the
feed-forward width). :func:`swap_feed_forwards` turns every such module of a model into a
``FusedFeedForward`` (the same module, parameters and state_dict keys; only its class
changes) whose activation runs :mod:`ase_tcfp32.kernels.swiglu`: one pass forward, one
backward, with the same FP32 arithmetic.

The calculator swaps them where it runs PET's attention on tensor cores
(:func:`ase_tcfp32.attention.on_tensor_cores`): ``fp32`` and ``tf32`` keep metatrain's
code. Inside ``torch.compile`` and on CPU tensors (Triton's interpreter aside) the
activation is metatrain's expression, which the compiler fuses itself.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .kernels.context import INTERPRETED
from .models import lazy_subclass, swap_class


def _kernels():
    """:mod:`ase_tcfp32.kernels.swiglu`, imported on first use (Triton takes a while)."""
    from .kernels import swiglu as kernels

    return kernels


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
    if y.dtype != torch.float32 or torch.compiler.is_compiling() or not (y.is_cuda or INTERPRETED):
        v, g = y.chunk(2, dim=-1)
        return v * torch.sigmoid(g)
    return _SwiGLUFunction.apply(y.contiguous())


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """``FeedForward.forward`` with :func:`swiglu` as its activation."""
    if not self.is_swiglu:
        return super(type(self), self).forward(x)
    return self.w_out(swiglu(self.w_in(x)))


_classes, __getattr__ = lazy_subclass(
    __name__, "FusedFeedForward", "metatrain.pet.modules.transformer.FeedForward", forward=_forward,
    __doc__="metatrain's FeedForward with its SwiGLU in :func:`swiglu`.")  # fmt: skip
"""metatrain's ``FeedForward`` and ``FusedFeedForward``, our subclass (:func:`ase_tcfp32.models.lazy_subclass`)."""


def swap_feed_forwards(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Run the SwiGLU of every metatrain ``FeedForward`` in ``module`` through :func:`swiglu`
    (``enable=False``: back to metatrain's code); return their names. Idempotent;
    parameters and state_dict keys are unchanged."""
    return swap_class(module, *_classes(), enable, takes=lambda child: child.is_swiglu)
