"""Precision modes: which exist, which the current hardware runs, what ``auto`` picks.

A *precision* names the arithmetic of every ``torch.nn.Linear`` product in the model:

========  =====================================================================
fp32      IEEE single precision (cuBLAS SGEMM / CPU BLAS); the baseline
tf32      one TF32 tensor-core pass; ~1e-4 relative error, for comparison only
tf32x3    three TF32 passes (hi*hi + hi*lo + lo*hi); FP32-level error
fp16x3    three FP16 passes over operands scaled per row by powers of two
          (hi*hi + hi*lo + lo*hi); FP32-level error
bf16x9    nine BF16 passes over a three-way split; FP32-level error
========  =====================================================================

Which *backend* computes a mode depends on the device: cuBLAS's own BF16x9
emulation on Blackwell (compute capability 10.0 and 10.3), our Gluon fp16x3 kernel on
Hopper (9.0), our Triton kernels for the others on Ampere and newer (8.x, 9.x, ...),
and the torch reference emulation on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "tf32", "tf32x3", "fp16x3", "bf16x9")
"""Every precision a user can force; ``"auto"`` picks one of them."""

FP32_ACCURATE = ("tf32x3", "fp16x3", "bf16x9")
"""The precisions that emulate FP32 (their attention also runs on tensor cores)."""

BLACKWELL_BF16X9 = ((10, 0), (10, 3))
"""Compute capabilities on which cuBLAS implements FP32 emulation with BF16x9."""


HOPPER = (9, 0)
"""The compute capability of the fp16x3 kernel (wgmma and TMA, written in Gluon)."""


class UnsupportedPrecisionError(ValueError):
    """The requested precision cannot run on the requested device."""


class EmulationWarning(UserWarning):
    """A precision runs through the slow torch reference emulation (CPU)."""


@dataclass(frozen=True)
class PrecisionSupport:
    """Whether ``precision`` runs on ``device``, through which ``backend``, and why."""

    precision: str
    device: str
    available: bool
    backend: str
    note: str


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def _has_gluon() -> bool:
    """Whether Triton's Gluon dialect (with the Hopper TMA and wgmma API) is importable."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ImportError:
        return False


@functools.cache
def triton_build_problem() -> str | None:
    """Why Triton cannot build and keep our kernels here, or None.

    Triton compiles small C modules on first use (its CUDA driver bindings and kernel
    launchers, with a C compiler against Python's headers), found as Triton finds them:
    ``$CC``, else ``gcc``, else ``clang``. Slim containers (CUDA runtime images,
    ``python:*-slim``) often lack both: torch runs there, our kernels would fail at their
    first launch. Triton also writes every compiled kernel to its cache folder; where that
    cannot be written (a container whose home folder is not writable) this points Triton
    at one in the temporary directory (``$TRITON_CACHE_DIR``), with a warning."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    cache = triton_cache_knobs()
    if cache is not None and (problem := _triton_cache_problem(cache)) is not None:
        return problem
    build = getattr(getattr(triton, "knobs", None), "build", None)  # Triton >= 3.4
    if getattr(build, "impl", None) is not None:
        return None  # the user's own build function
    compiler = os.environ.get("CC")
    if compiler is not None and shutil.which(compiler) is None:
        return f"CC={compiler!r} is not an executable"
    if compiler is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        return "no C compiler (gcc or clang on PATH, or $CC); install one, e.g. 'apt install gcc'"
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"Python's C headers are missing ({include}/Python.h); install them, e.g. 'apt install python3-dev'"
    return None


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return True
    except OSError:
        return False


def triton_cache_knobs():
    """``triton.knobs.cache``, whose ``dir`` is the folder Triton keeps compiled kernels in
    (Triton >= 3.4; None before, or without Triton)."""
    try:
        import triton
    except ImportError:
        return None
    cache = getattr(getattr(triton, "knobs", None), "cache", None)
    return cache if hasattr(cache, "dir") else None


def _triton_cache_problem(cache) -> str | None:
    """Triton's ``cache`` folder made writable (see :func:`triton_build_problem`), or why not."""
    folder = cache.dir
    if _writable(folder):
        return None
    fallback = os.path.join(tempfile.gettempdir(), f"triton-cache-{os.getuid()}")
    if not _writable(fallback):
        return f"neither Triton's cache folder {folder} nor {fallback} can be written"
    warnings.warn(
        f"Triton's cache folder {folder} cannot be written: compiled GPU kernels go to {fallback} "
        "(set TRITON_CACHE_DIR to a lasting folder to keep them across reboots)",
        stacklevel=2,
    )
    os.environ["TRITON_CACHE_DIR"] = cache.dir = fallback  # this process and the compiler's workers
    return None


def support(precision: str, device: torch.device | str) -> PrecisionSupport:
    """Tell whether ``precision`` runs on ``device`` and through which backend."""
    check_name(precision, allow_auto=False)
    device = torch.device(device)
    cc = _capability(device)
    if precision == "fp32":
        backend = "cuBLAS SGEMM" if cc else "CPU BLAS"
        return PrecisionSupport(precision, str(device), True, backend, "IEEE FP32 baseline")
    if cc is None:
        return PrecisionSupport(
            precision,
            str(device),
            True,
            "reference",
            "torch reference emulation: the GPU's numerics, slower than fp32",
        )
    if cc < (8, 0):
        return PrecisionSupport(
            precision,
            str(device),
            False,
            "none",
            f"compute capability {cc[0]}.{cc[1]} has no TF32/BF16 tensor cores (needs 8.0+)",
        )
    built = precision != "bf16x9" or cc not in BLACKWELL_BF16X9  # by Triton: everything but cuBLAS's BF16x9
    if built and (problem := triton_build_problem()) is not None:
        return PrecisionSupport(
            precision,
            str(device),
            False,
            "none",
            f"our GPU kernels need Triton to build its launchers, which it cannot here: {problem}",
        )
    if precision == "fp16x3":
        if cc != HOPPER:
            return PrecisionSupport(
                precision,
                str(device),
                False,
                "none",
                f"fp16x3 has a kernel for Hopper (compute capability 9.0) only, not {cc[0]}.{cc[1]}; "
                "tf32x3 is the FP32-accurate mode here",
            )
        if not _has_gluon():
            return PrecisionSupport(
                precision,
                str(device),
                False,
                "none",
                "the fp16x3 kernel is written in Gluon, which this Triton lacks (needs Triton 3.6, as torch 2.11 pins)",
            )
        return PrecisionSupport(precision, str(device), True, "gluon", "ase_tcfp32 Gluon kernel (Hopper)")
    if precision == "bf16x9" and cc in BLACKWELL_BF16X9:
        return PrecisionSupport(
            precision,
            str(device),
            True,
            "cuBLAS BF16x9",
            "cuBLAS FP32 emulation (CUBLAS_COMPUTE_32F_EMULATED_16BFX9)",
        )
    return PrecisionSupport(precision, str(device), True, "triton", "ase_tcfp32 Triton kernel")


def auto_precision(device: torch.device | str) -> tuple[str, str]:
    """The precision ``"auto"`` picks on ``device``, and the reason in words."""
    device = torch.device(device)
    cc = _capability(device)
    if cc is None:
        return "fp32", f"device '{device}' has no tensor cores"
    name = f"{torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})"
    if cc in BLACKWELL_BF16X9:
        return "bf16x9", f"{name} has cuBLAS BF16x9 FP32 emulation"
    if cc == HOPPER and support("fp16x3", device).available:
        return "fp16x3", f"{name} runs our fp16x3 kernel (FP16 tensor cores, per-row scaling)"
    if cc[0] in (8, 9):
        tf32x3 = support("tf32x3", device)
        return ("tf32x3", f"{name} has TF32 tensor cores") if tf32x3.available else ("fp32", tf32x3.note)
    return "fp32", f"{name} is not in the tested table (9.0 -> fp16x3; 8.x, 9.x -> tf32x3; 10.0, 10.3 -> bf16x9)"


def check_name(precision: object, *, allow_auto: bool = True) -> str:
    """Return ``precision`` if it names a mode, else raise a ValueError listing them."""
    valid = (("auto",) if allow_auto else ()) + PRECISIONS
    if not isinstance(precision, str) or precision not in valid:
        raise ValueError(f"unknown precision {precision!r}; valid choices: {', '.join(valid)}")
    return precision


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """Turn a user's choice into a concrete precision that ``device`` can run.

    ``"auto"`` follows :func:`auto_precision` and warns when it falls back to fp32;
    a forced mode the hardware cannot run raises :class:`UnsupportedPrecisionError`;
    a forced emulated mode on CPU warns that it runs the slow reference emulation.
    """
    check_name(precision)
    device = torch.device(device)
    if precision == "auto":
        chosen, why = auto_precision(device)
        if chosen == "fp32":
            warnings.warn(f"precision='auto' uses fp32: {why}", stacklevel=3)
        return chosen
    info = support(precision, device)
    if not info.available:
        raise UnsupportedPrecisionError(
            f"precision {precision!r} cannot run on {device}: {info.note}; use precision='fp32' or 'auto'"
        )
    if info.backend == "reference":
        warnings.warn(
            f"precision {precision!r} on {device} runs the torch reference emulation: "
            "the tensor-core numerics, but slower than fp32 (meant for checking accuracy)",
            EmulationWarning,
            stacklevel=3,
        )
    return precision


def available_precisions(device: torch.device | str | None = None) -> list[PrecisionSupport]:
    """Every precision with its availability on ``device`` (default: CUDA if present)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return [support(p, device) for p in PRECISIONS]


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """Run the block with IEEE FP32 cuBLAS matmuls, restoring the caller's setting.

    Keeps a process-wide ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` set by
    other code from leaking into our FP32 baseline or the model's non-Linear matmuls,
    without changing that setting for anything outside the block.
    """
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved
