"""cuBLAS's own FP32 emulation with BF16x9 (Blackwell, compute capability 10.0 / 10.3).

Each GEMM is one ``cublasGemmEx`` call with compute type
``CUBLAS_COMPUTE_32F_EMULATED_16BFX9`` on torch's cuBLAS handle and stream, with the
emulation strategy (``"performant"`` or ``"eager"``) set for that call and restored
after it. Nothing process-wide changes: no environment variable, no math mode, so other
FP32 matmuls in the process stay IEEE. On GPUs without the emulation (Hopper, measured
on H200 with cuBLAS 13.1) cuBLAS silently runs plain SGEMM for this compute type, which
is why :func:`ase_tcfp32.precision.support` routes only 10.0 / 10.3 here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

COMPUTE_32F_EMULATED_16BFX9 = 78
STRATEGIES = {"default": 0, "performant": 1, "eager": 2}
_R_32F = 0
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1


@functools.lru_cache(maxsize=1)
def libcublas() -> ctypes.CDLL:
    """The cuBLAS library torch loaded (found by soname once torch has initialised it)."""
    torch.zeros(1, device="cuda")  # a CUDA context first, then torch's cuBLAS handle
    torch.cuda.current_blas_handle()
    for soname in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(soname)
        except OSError:
            continue
    raise RuntimeError("could not load the cuBLAS library that torch uses")


def version() -> str:
    """The cuBLAS version torch uses, as ``major.minor.patch``."""
    parts = []
    for kind in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        value = ctypes.c_int(-1)
        _check(libcublas().cublasGetProperty(kind, ctypes.byref(value)), "cublasGetProperty")
        parts.append(str(value.value))
    return ".".join(parts)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with cuBLAS status {status}")


def get_strategy(handle: int) -> int:
    """The emulation strategy set on a cuBLAS ``handle``."""
    value = ctypes.c_int(-1)
    _check(
        libcublas().cublasGetEmulationStrategy(ctypes.c_void_p(handle), ctypes.byref(value)),
        "cublasGetEmulationStrategy",
    )
    return value.value


def set_strategy(handle: int, strategy: int) -> None:
    _check(
        libcublas().cublasSetEmulationStrategy(ctypes.c_void_p(handle), ctypes.c_int(strategy)),
        "cublasSetEmulationStrategy",
    )


def gemm_bf16x9(a: torch.Tensor, b: torch.Tensor, *, transpose_b: bool, strategy: str = "performant") -> torch.Tensor:
    """``a @ b.T`` (``transpose_b``) or ``a @ b`` for row-major FP32 CUDA tensors, as BF16x9."""
    m, k = a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    out = torch.empty((m, n), device=a.device, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    handle = torch.cuda.current_blas_handle()  # bound to the current stream by torch
    saved = get_strategy(handle)
    set_strategy(handle, STRATEGIES[strategy])
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ptr = ctypes.c_void_p
    try:
        # column-major view: out^T [n, m] = op(b) [n, k] @ a^T [k, m]
        status = libcublas().cublasGemmEx(
            ptr(handle),
            _OP_T if transpose_b else _OP_N,
            _OP_N,
            n,
            m,
            k,
            ctypes.byref(one),
            ptr(b.data_ptr()),
            _R_32F,
            k if transpose_b else n,
            ptr(a.data_ptr()),
            _R_32F,
            k,
            ctypes.byref(zero),
            ptr(out.data_ptr()),
            _R_32F,
            n,
            COMPUTE_32F_EMULATED_16BFX9,
            _GEMM_DEFAULT,
        )
        _check(status, "cublasGemmEx")
    finally:
        set_strategy(handle, saved)
    return out


class CublasBF16x9Backend:
    """cuBLAS BF16x9 emulation, with the layer interface of every backend."""

    name = "cuBLAS BF16x9"

    def __init__(self, strategy: str = "performant"):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown emulation strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        self.strategy = strategy

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().float().contiguous()  # cuBLAS splits internally

    def forward(self, x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = gemm_bf16x9(x, prepared, transpose_b=True, strategy=self.strategy)
        return y if bias is None else y.add_(bias)

    def grad_input(self, grad_y: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor:
        return gemm_bf16x9(grad_y, prepared, transpose_b=False, strategy=self.strategy)
