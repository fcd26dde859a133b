"""Launch configurations tuned once per GPU and GEMM shape, remembered on disk.

The first time a layer of output width N and depth K meets a kernel on a GPU, each
candidate configuration is timed on that shape (a few hundred ms, plus compiling the
candidates) and the fastest is written to a JSON file; later calls, in this process or
any other on the same machine, read it. Candidates differ only in tile rows and columns,
pipeline depth, warps and tile order, never in the K-tile: each output element sums the
same products in the same order under every candidate, so tuning never changes a number
(the GPU tests check the bits).

The file is ``$ASE_TCFP32_CACHE/autotune.json`` (default ``~/.cache/ase-tcfp32``);
``ASE_TCFP32_AUTOTUNE=0`` turns tuning off (every layer takes the first candidate).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_lock = threading.Lock()
_memory: dict[str, dict[str, dict]] = {}
"""Configurations known to this process, per cache file, by key."""


def cache_file() -> Path:
    """Where tuned configurations are kept."""
    folder = os.environ.get("ASE_TCFP32_CACHE") or Path.home() / ".cache" / "ase-tcfp32"
    return Path(folder) / "autotune.json"


def enabled() -> bool:
    """Whether to tune (``ASE_TCFP32_AUTOTUNE`` unset or not ``0``)."""
    return os.environ.get("ASE_TCFP32_AUTOTUNE", "1") != "0"


def device_key(device: torch.device) -> str:
    """The GPU model and the software whose choices a tuned configuration reflects."""
    import triton

    from .._version import __version__

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}|sm{major}{minor}|triton {triton.__version__}|ase-tcfp32 {__version__}"


def _read(path: Path) -> dict:
    """The configurations in ``path`` ({} when missing; a damaged file is ignored with a warning)."""
    if not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as error:
        warnings.warn(
            f"ignoring the unreadable autotuning cache {path} ({error}); configurations are tuned again", stacklevel=4
        )
        return {}


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``'s lock file: one process at a time merges into it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _add(path: Path, key: str, configuration: dict) -> None:
    """Add ``key`` to the cache file, keeping what other processes wrote: under a lock (two
    processes filling an empty cache at once keep both their entries) and through a
    temporary file and an atomic rename (an interrupted write leaves the old file whole)."""
    try:
        with _locked(path):
            configurations = {**_read(path), key: configuration}
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(configurations, indent=1, sort_keys=True))
            os.replace(temporary, path)
    except OSError as error:
        warnings.warn(
            f"could not write the autotuning cache {path} ({error}); tuned configurations last for this process only",
            stacklevel=4,
        )


def known() -> dict[str, dict]:
    """The configurations tuned so far on this machine (the cache file), by key."""
    return _read(cache_file())


def tuned(key: str, candidates: list[dict], measure: Callable[[dict], float]) -> dict:
    """The candidate with the smallest ``measure(candidate)`` (ms) for ``key``, measured
    the first time and remembered (memory and :func:`cache_file`). Candidates that fail
    (e.g. out of shared memory) are skipped; the first one must work."""
    if not enabled() or len(candidates) == 1:
        return candidates[0]
    path = cache_file()
    with _lock:
        memory = _memory.setdefault(str(path), {})
        if key not in memory:
            memory.update(_read(path))
        if memory.get(key) in candidates:
            return dict(memory[key])
        times = []
        for candidate in candidates:
            try:
                times.append(measure(candidate))
            except Exception:  # noqa: BLE001 - a candidate this GPU cannot run is no candidate
                if candidate is candidates[0]:
                    raise
                times.append(float("inf"))
        memory[key] = candidates[min(range(len(candidates)), key=times.__getitem__)]
        _add(path, key, memory[key])
        return dict(memory[key])


def tuning_rows(n: int, k: int) -> int:
    """Rows of the random x [rows, k] that :func:`tuned_gemm` times a weight [n, k] on:
    enough to fill a large GPU tens of times over, x and the output at most ~256 MB of
    FP32 each."""
    return max(8192, min(2**18, 2**26 // max(n, k)))


def tuned_gemm(
    kernel: str,
    n: int,
    k: int,
    device: torch.device,
    candidates: list[dict],
    launcher: Callable[[dict], Callable[[torch.Tensor], object]],
) -> dict:
    """:func:`tuned` for a GEMM with a weight [n, k] on ``device``: ``launcher(config)``
    gives the function that launches it on x [rows, k], timed by Triton's ``do_bench``
    (median ms). x is random, made only if something is measured, with
    :func:`tuning_rows` rows: the choice is for the large systems, where GEMM time matters."""
    from triton.testing import do_bench

    @functools.cache
    def operand() -> torch.Tensor:
        return torch.randn(tuning_rows(n, k), k, device=device)

    def measure(config: dict) -> float:
        run, x = launcher(config), operand()
        return do_bench(lambda: run(x), warmup=5, rep=25, return_mode="median")

    from .._progress import doing

    with doing(f"tuning the {kernel} GEMM of a {k} -> {n} layer"):
        return tuned(f"{device_key(device)}|{kernel}|n={n}|k={k}", candidates, measure)
