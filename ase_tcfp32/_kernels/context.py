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

The first kernel a process loads also has Triton hash its own installation (its compiler's
sources and ``libtriton.so``, hundreds of MB) into the key of its kernel cache: 0.44 s of
a 192-atom calculator's 5 s start in a second process on an H200. :func:`remember_triton_key`
keeps that hash on disk, next to the tuned configurations, under a fingerprint of the same
files' sizes and modification times, so a second process reads it instead; any change to
Triton's files gives a new fingerprint, and the hash is computed again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import sysconfig
import threading
import warnings

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
        remember_triton_key()
        bind_primary_context(index)
        bound.add(index)
    return _SAME


@functools.cache
def remember_triton_key() -> None:
    """Give Triton the hash of its installation from our cache folder when the files it
    hashes are unchanged (see the module doc); otherwise let it compute the hash and keep
    it. Without the function this Triton version hashes with, nothing changes."""
    import triton
    import triton.runtime.cache as cache

    from .autotune import cache_file

    computed = getattr(cache, "triton_key", None)
    if not callable(getattr(computed, "cache_clear", None)):  # not the lru-cached function of Triton 3.x
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(cache.__file__)))
    library = os.path.join(root, "_C", f"libtriton.{sysconfig.get_config_var('EXT_SUFFIX').split('.')[-1]}")
    stats = [cache.__file__, library]
    for folder in ("compiler", "backends", "language"):
        for where, _, names in os.walk(os.path.join(root, folder)):
            stats += [os.path.join(where, name) for name in sorted(names) if name.endswith(".py")]
    try:
        described = "\n".join(f"{path} {stat.st_size} {stat.st_mtime_ns}" for path in stats for stat in [os.stat(path)])
    except OSError:
        return
    fingerprint = hashlib.sha256(f"{triton.__version__}\n{described}".encode()).hexdigest()
    path = cache_file().with_name("triton_key.json")
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: computed and written again
        known = {}
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(fingerprint), str):
        value = known[fingerprint]
        cache.triton_key = functools.cache(lambda: value)
        return
    known[fingerprint] = computed()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(known))
        os.replace(partial, path)  # atomic: a reader sees the old file or the new one
    except OSError:  # a read-only cache folder: each process computes the hash, as Triton alone does
        pass


def cutoff_kernel_usable(device: torch.device) -> bool:
    """Whether PET's adaptive-cutoff solver can run in our kernel on ``device`` (CUDA, or
    CPU tensors under Triton's interpreter); on a GPU where Triton cannot build its
    launchers, metatrain's torch code runs instead, with a warning saying why."""
    if INTERPRETED:
        return True
    if device.type != "cuda":
        return False
    from ..precision import triton_build_problem

    problem = triton_build_problem()
    if problem is not None:
        warnings.warn(
            f"PET's adaptive cutoffs run in metatrain's torch code, slower: Triton cannot build its launchers "
            f"here ({problem})",
            stacklevel=3,
        )
    return problem is None
