"""Accuracy watchdog: emulated GEMMs checked against FP64 while they run.

The FP32-emulating precisions are FP32-accurate on the inputs PET's layers see, not on
every input (``docs/precision.md`` says where not: e.g. fp16x3 on a K-tile holding one
entry ~2^22 times larger than the rest, whose small entries lose their low bits to the
tile's shared scale). With ``check_accuracy=N`` every N-th call of each emulated layer,
starting with the first, also recomputes :data:`ROWS` of its output rows (and, in the
backward pass, of its input-gradient rows) in FP64 and in plain FP32, and compares the
componentwise errors

    e = max |y - y_exact| / (sum_k |x_k| |w_k| + |b|)   in units of u = 2^-24

of the emulated and the FP32 result. When the emulated error exceeds :data:`FACTOR` times
FP32's (or :func:`floor` u, whichever is larger), a :class:`PrecisionWarning` names the
layer, the precision and both errors, once per layer.

Checks run on the layer's device without synchronising; their results are read when the
engine reads the step's results (:func:`deferred`), or at once outside an engine. Inside
a CUDA-graph capture nothing is checked: the graph engine instead evaluates the due steps
eagerly under :func:`check_all`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from .precision import ieee_fp32_matmul

ROWS = 8
"""Rows sampled per check (evenly spaced, shifted by one row at every check)."""

FACTOR = 8.0
"""Warn when the emulated error exceeds this multiple of FP32's on the same rows."""

FLOOR = 4.0
"""... or this many units 2^-24 (or more for long contractions, see :func:`floor`),
whichever is larger: FP32's own error on a few rows can be exactly zero."""


def floor(depth: int) -> float:
    """Errors up to this many units 2^-24 never warn, for a contraction of ``depth`` terms:
    :data:`FLOOR`, or sqrt(depth), the typical error of an FP32 dot product summed term
    by term (Higham and Mary's probabilistic bound), whichever is larger. On PET's layers
    fp16x3 and tf32x3 measured 0.2-0.5x cuBLAS FP32's normwise error on the H200, but
    cuBLAS's blocked sums can make its componentwise error on 8 rows unusually small: a
    random PET-S-shaped model's 1024-deep layer gave fp16x3 4.2 units against cuBLAS's
    0.5 (8.3x), which a fixed floor of 4 units reported."""
    return max(FLOOR, depth**0.5)


ENV = "ASE_TCFP32_CHECK_ACCURACY"

_UNIT = 2.0**-24
_state = threading.local()


class PrecisionWarning(UserWarning):
    """An emulated GEMM was measured less accurate than FP32 on its actual inputs."""


CALCULATOR_EVERY = 10_000
"""The calculator's default interval (``swap_linear_layers`` and ``TCLinear``: off). A due
step of the graph engine runs eagerly with every layer checked: 83.8 ms against a 4.9 ms
replay (192 water atoms, bundled demo model, fp16x3, H200), 1.6% of the run at every
1,000th step, 0.16% at every 10,000th."""


def check_every(value: int | None, default: int = 0) -> int:
    """The check interval: ``value`` when given, else ``$ASE_TCFP32_CHECK_ACCURACY``, else
    ``default`` (0: off); a clear error for anything that is not a non-negative integer."""
    source = "check_accuracy"
    if value is None:
        value, source = os.environ.get(ENV, str(default)).strip(), ENV
        value = int(value) if value.isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source} must be a non-negative integer (0: off, N: every N-th call), got {value!r}")
    return value


@contextlib.contextmanager
def check_all() -> Iterator[None]:
    """Check every call of every watched layer in this block (the graph engine's due steps)."""
    saved = getattr(_state, "all", False)
    _state.all = True
    try:
        yield
    finally:
        _state.all = saved


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Collect the block's checks on the device and judge them at its end (one read)."""
    outer = getattr(_state, "pending", None)
    _state.pending = [] if outer is None else outer
    try:
        yield
    finally:
        if outer is None:
            pending, _state.pending = _state.pending, None
            _judge(pending)


def errors(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """Componentwise errors (units 2^-24) of ``y`` [R, N] and of torch's FP32
    ``x @ weight.T + bias`` against FP64, as a device tensor [2]; entries whose exact value
    is not finite or zero-scaled are skipped, a non-finite ``y`` where it is finite counts
    as an infinite error."""
    xd, wd = x.double(), weight.double()
    exact, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    with ieee_fp32_matmul():
        fp32 = torch.nn.functional.linear(x, weight, bias)
    usable = torch.isfinite(exact) & (scale > 0)
    scale = torch.where(usable, scale, 1.0)

    def worst(result: torch.Tensor) -> torch.Tensor:
        error = (result.double() - exact).abs() / scale
        error = torch.where(usable, torch.nan_to_num(error, nan=torch.inf), 0.0)
        return error.amax() / _UNIT if error.numel() else error.new_zeros(())

    return torch.stack([worst(y), worst(fp32)])


def watch(
    layer, direction: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> None:
    """Check ``y = x @ weight.T + bias`` of ``layer`` (a TCLinear) if this call is due."""
    count, checked = layer._calls.get(direction, 0), due(layer, direction)
    count_call(layer, direction)
    if not checked or x.shape[0] == 0:
        return
    rows = (torch.arange(ROWS, device=x.device) * x.shape[0]) // ROWS
    rows = torch.unique((rows + count) % x.shape[0])
    with torch.no_grad():
        found = errors(x.detach()[rows], weight.detach(), None if bias is None else bias.detach(), y.detach()[rows])
    pending = getattr(_state, "pending", None)
    item = (layer, direction, x.shape[1], found)
    if pending is None:
        _judge([item])
    else:
        pending.append(item)


def due(layer, direction: str) -> bool:
    """Whether the next call of ``layer`` in ``direction`` is to be checked: every N-th call
    (the first included), every call under :func:`check_all`; never in a CUDA-graph capture
    or once the layer has warned. A fused kernel then steps aside for the plain GEMM that
    :func:`watch` compares."""
    every = getattr(layer, "check_accuracy", 0)
    if not every or layer.precision == "tf32" or layer._warned:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return layer._calls.get(direction, 0) % every == 0 or getattr(_state, "all", False)


def count_call(layer, direction: str) -> None:
    """Count a call of ``layer`` in ``direction``, checked (:func:`watch`) or run fused."""
    if getattr(layer, "check_accuracy", 0) and layer.precision != "tf32":
        layer._calls[direction] = layer._calls.get(direction, 0) + 1


def _judge(pending: list) -> None:
    if not pending:
        return
    values = torch.stack([found.cpu() for *_, found in pending]).tolist()
    for (layer, direction, depth, _), (emulated, fp32) in zip(pending, values):
        if emulated > max(FACTOR * fp32, floor(depth)) and not layer._warned:
            layer._warned = True
            warnings.warn(
                f"layer {layer.name or 'TCLinear'!r} ({layer.in_features} -> {layer.out_features}), "
                f"{layer.precision}, {direction}: error {emulated:.3g} x 2^-24 against FP32's "
                f"{fp32:.3g} x 2^-24 on the same {ROWS} sampled rows (componentwise, vs FP64): "
                f"these inputs are outside where {layer.precision} is FP32-accurate "
                "(docs/precision.md); precision='fp32' gives FP32's results",
                PrecisionWarning,
                stacklevel=2,
            )
