"""Launching our Triton/Gluon kernels from any thread.

Triton launches on the calling thread's *current* CUDA device and creates TMA descriptors
with driver calls that need a CUDA context bound to that thread. A thread that has not yet
made a CUDA runtime call has none: PyTorch's autograd worker thread (where every backward
runs), a user's own threads. The runtime binds the device's primary context lazily, at the
first call that needs one (an allocation, a synchronisation), so whether a first backward
worked used to depend on whether PyTorch's caching allocator happened to call
``cudaMalloc`` on that thread first (measured on an H200: a fresh process whose tuning
filled the allocator's cache failed with "Failed to create tensor map descriptor: invalid
device context"). :func:`on_device` binds the primary context once per thread and device
and makes the device current for the launch only, so no caller sees its current device
change.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs our kernels on CPU tensors (the CPU tests)."""

_thread = threading.local()
_SAME = contextlib.nullcontext()


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"CUDA driver call {call} failed with error {status}")


def bind_primary_context(index: int) -> None:
    """Bind device ``index``'s primary context (the one PyTorch uses) to the calling
    thread, unless a context is already current there."""
    driver = _driver()
    current = ctypes.c_void_p()
    _check(driver.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value:
        return
    torch.cuda.init()  # cuInit and the primary context, as PyTorch makes them
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(driver.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which a kernel on ``device`` can be launched from this thread (for CUDA:
    the device's context bound to the thread (once per thread) and the device current
    for the duration, a no-op when it already is; nothing for a CPU device)."""
    if device.type != "cuda":  # Triton's interpreter, on CPU tensors
        return _SAME
    current = torch.cuda.current_device()
    index = current if device.index is None else device.index
    if index != current:
        return torch.cuda.device(index)  # cudaSetDevice binds that device's context
    bound = _thread.__dict__.setdefault("bound", set())
    if index not in bound:
        bind_primary_context(index)
        bound.add(index)
    return _SAME
