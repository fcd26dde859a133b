"""``TCLinear``: ``torch.nn.Linear`` with tensor-core FP32-emulating products.

The module keeps ``nn.Linear``'s parameters and state_dict keys; its forward and the
gradient with respect to its input (what forces and stress need) both run the
emulated GEMM of its precision. The weight is split into tensor-core words once and
again only when it changes. The gradient with respect to the weight, when asked for,
takes the ordinary FP32 path. Eager calls run an autograd Function; inside
``torch.compile`` the same computation is the custom op ``ase_tcfp32::linear``, which
the compiler calls without looking into it.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import watchdog
from ._backends import get_backend
from .precision import PRECISIONS, check_name

EMULATED = tuple(p for p in PRECISIONS if p != "fp32")

MIN_EMULATED_K = 16
"""FP32-emulating precisions leave layers with fewer inputs than this in FP32: at tiny
K the split's dropped lo*lo term makes tf32x3 several times less accurate than FP32
(measured 3-8x at K <= 5), and such GEMMs are memory-bound, so FP32 costs nothing."""


_LAYERS: dict[int, weakref.ref] = {}
"""Live TCLinear layers by id, so that the custom op finds a layer's cached weight split."""
_ids = itertools.count()


def _split(weight: torch.Tensor, precision: str, emulate: str | None, layer: int, device: torch.device):
    """The backend, the weight's split (the layer's cached one, or made now for layer < 0)
    and the layer (None for layer < 0)."""
    backend = get_backend(precision, device, emulate)
    owner = _LAYERS[layer]() if layer >= 0 else None
    return backend, (owner.prepared_weight(device) if owner is not None else backend.prepare(weight)), owner


def _forward(backend, prepared, owner, x, weight, bias):
    y = backend.forward(x, prepared, bias)
    if owner is not None:
        watchdog.watch(owner, "forward", x, weight, bias, y)
    return y


def _grad_input(backend, prepared, owner, grad_y, weight):
    grad_x = backend.grad_input(grad_y, prepared)
    if owner is not None:
        watchdog.watch(owner, "input gradient", grad_y, weight.T, None, grad_x)
    return grad_x


@torch.library.custom_op("ase_tcfp32::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, precision: str, emulate: str | None, layer: int
) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` -> [M, N] in ``precision``; opaque to ``torch.compile``."""
    return _forward(*_split(weight, precision, emulate, layer, x.device), x, weight, bias)


@torch.library.custom_op("ase_tcfp32::linear_grad_input", mutates_args=())
def _linear_grad_input_op(
    grad_y: torch.Tensor, weight: torch.Tensor, precision: str, emulate: str | None, layer: int
) -> torch.Tensor:
    """``grad_y [M, N] @ weight`` -> [M, K] in ``precision``: the input gradient."""
    return _grad_input(*_split(weight, precision, emulate, layer, grad_y.device), grad_y, weight)


@_linear_op.register_fake
def _(x, weight, bias, precision, emulate, layer):
    return x.new_empty(x.shape[0], weight.shape[0])


@_linear_grad_input_op.register_fake
def _(grad_y, weight, precision, emulate, layer):
    return grad_y.new_empty(grad_y.shape[0], weight.shape[1])


def _grads(needs: tuple, grad_y: torch.Tensor, x, grad_input) -> tuple:
    """Gradients of ``x @ w.T + b`` for x (through ``grad_input``), w and b, as needed."""
    grad_x = grad_input(grad_y.contiguous()) if needs[0] else None
    grad_w = grad_y.T @ x if needs[1] else None
    grad_b = grad_y.sum(0) if needs[2] else None
    return grad_x, grad_w, grad_b, None, None, None


def _setup_context(ctx, inputs, output):
    x, weight, bias, ctx.precision, ctx.emulate, ctx.layer = inputs
    ctx.save_for_backward(x if weight.requires_grad else None, weight)


def _backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    return _grads(
        ctx.needs_input_grad,
        grad_y,
        x,
        lambda g: _linear_grad_input_op(g, weight, ctx.precision, ctx.emulate, ctx.layer),
    )


_linear_op.register_autograd(_backward, setup_context=_setup_context)


class _LinearFunction(torch.autograd.Function):
    """The eager twin of the custom op: the same kernels without the op's Python dispatch,
    which made a 192-atom PET-S step 1.8x slower on H200 (64 vs 35 ms)."""

    @staticmethod
    def forward(ctx, x, weight, bias, precision, emulate, layer):
        ctx.split = _split(weight, precision, emulate, layer, x.device)
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return _forward(*ctx.split, x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        return _grads(ctx.needs_input_grad, grad_y, x, lambda g: _grad_input(*ctx.split, g, weight))


def _linear(input, weight, bias, precision: str, emulate: str | None, layer: int) -> torch.Tensor:
    x2d = input.reshape(-1, input.shape[-1])
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    if torch.compiler.is_compiling():
        y = _linear_op(x2d, weight, bias, precision, emulate, layer)
    else:
        y = _LinearFunction.apply(x2d, weight, bias, precision, emulate, layer)
    return y.reshape(*input.shape[:-1], weight.shape[0])


def tc_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    precision: str = "tf32x3",
    emulate: str | None = None,
) -> torch.Tensor:
    """Functional twin of :class:`TCLinear`: ``input @ weight.T + bias`` in ``precision``.

    ``input`` [..., K] and ``weight`` [N, K] are float32; returns [..., N]. The weight is
    split into tensor-core words on every call (:class:`TCLinear` keeps its split).
    ``emulate`` names a GPU (``"A100"``, ``"H100"``...) whose tensor cores the
    bit-accurate model of :mod:`ase_tcfp32.tcmodel` imitates (slow, CPU).
    """
    if precision not in EMULATED:
        raise ValueError(f"tc_linear needs one of {', '.join(EMULATED)}, got {precision!r}")
    if input.dtype != torch.float32 or weight.dtype != torch.float32:
        raise TypeError(f"tc_linear needs float32 tensors, got {input.dtype} and {weight.dtype}")
    return _linear(input, weight, bias, precision, emulate, -1)


class TCLinear(nn.Linear):
    """``nn.Linear`` whose products run in an emulated ``precision`` (see :mod:`ase_tcfp32.precision`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        precision: str = "tf32x3",
        emulate: str | None = None,
        check_accuracy: int | None = None,
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.precision = precision
        self.emulate = emulate
        self.name = ""
        self.check_accuracy = watchdog.check_every(check_accuracy)
        self._register()

    def _register(self) -> None:
        """A fresh id under which the custom op finds this layer (and its weight split)."""
        self._layer_id = next(_ids)
        self._cache_key: tuple | None = None
        self._prepared: object | None = None
        self._calls: dict[str, int] = {}  # calls per direction, for the watchdog
        self._warned = False
        _LAYERS[self._layer_id] = weakref.ref(self, lambda _, i=self._layer_id: _LAYERS.pop(i, None))

    def __setstate__(self, state: dict) -> None:  # copies (deepcopy, pickle) get their own id
        super().__setstate__(state)
        self._register()

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in EMULATED:
            raise ValueError(f"TCLinear precision must be one of {', '.join(EMULATED)}, got {value!r}")
        self._precision = value
        self._cache_key = None

    @property
    def emulate(self) -> str | None:
        return self._emulate

    @emulate.setter
    def emulate(self, value: str | None) -> None:
        self._emulate = value
        self._cache_key = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        precision: str,
        emulate: str | None = None,
        check_accuracy: int | None = None,
        name: str = "",
    ) -> TCLinear:
        """A TCLinear sharing ``linear``'s parameters (no copy); ``name`` appears in the
        watchdog's warnings."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.precision = precision
        layer.emulate = emulate
        layer.name = name
        layer.check_accuracy = watchdog.check_every(check_accuracy)
        layer._register()
        return layer

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def prepared_weight(self, device: torch.device) -> object:
        """The backend's split of the weight, redone when the weight or device changes."""
        w = self.weight
        key = (self._precision, self._emulate, device, w.data_ptr(), w._version, w.shape)
        if key != self._cache_key:
            self._prepared = get_backend(self._precision, device, self._emulate).prepare(w)
            self._cache_key = key
        return self._prepared

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _linear(input, self.weight, self.bias, self._precision, self._emulate, self._layer_id)

    def extra_repr(self) -> str:
        emulate = f", emulate={self._emulate}" if self._emulate else ""
        return f"{super().extra_repr()}, precision={self._precision}{emulate}"


def swap_linear_layers(
    module: nn.Module, precision: str, *, emulate: str | None = None, check_accuracy: int | None = None
) -> list[str]:
    """Make every Linear layer of ``module`` compute in ``precision``; return their names.

    ``emulate`` runs the layers through the tensor-core model of that GPU (CPU only).
    ``check_accuracy=N`` checks every N-th call of each layer against FP64
    (:mod:`ase_tcfp32.watchdog`; default ``$ASE_TCFP32_CHECK_ACCURACY``, else off); single-pass
    ``"tf32"`` is never checked (it is not FP32-accurate by design).

    Exact ``nn.Linear`` layers become :class:`TCLinear` (sharing parameters) and
    existing TCLinear layers change precision; ``"fp32"`` turns them all back into
    ``nn.Linear`` (see also :func:`restore_linear_layers`). Idempotent. For tf32x3 and
    bf16x9, layers with fewer than :data:`MIN_EMULATED_K` inputs (PET's K=4 edge
    embedder) stay FP32. Subclasses of ``nn.Linear`` other than TCLinear are left alone.
    """
    check_name(precision, allow_auto=False)
    every = watchdog.check_every(check_accuracy)
    if precision == "tf32" and check_accuracy:
        raise ValueError("check_accuracy checks the FP32-accurate precisions; tf32 is ~1e-4 accurate by design")
    changed = []
    for name, child in list(module.named_modules()):
        keep_fp32 = precision == "fp32" or (
            precision != "tf32" and isinstance(child, nn.Linear) and child.in_features < MIN_EMULATED_K
        )
        if isinstance(child, TCLinear):
            if keep_fp32:
                _set_submodule(module, name, child.to_linear())
            else:
                child.precision, child.emulate, child.name, child.check_accuracy = precision, emulate, name, every
            changed.append(name)
        elif type(child) is nn.Linear and not keep_fp32:
            _set_submodule(module, name, TCLinear.from_linear(child, precision, emulate, every, name))
            changed.append(name)
    return changed


def restore_linear_layers(module: nn.Module) -> list[str]:
    """Turn every TCLinear of ``module`` back into ``nn.Linear``; return their names."""
    return swap_linear_layers(module, "fp32")


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)
