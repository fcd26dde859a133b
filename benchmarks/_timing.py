"""Timing helpers shared by the benchmarks (run from this folder: ``python benchmarks/x.py``)."""

from __future__ import annotations

import time

import torch


def timed(call) -> float:
    """Seconds that ``call()`` takes, the GPU (if any) synchronised before and after: what
    it costs the host and the device."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def md_step_times(dyn, steps: int) -> list[float]:
    """Seconds of each of ``steps`` steps of the ASE dynamics ``dyn`` (:func:`timed`)."""
    return [timed(lambda: dyn.run(1)) for _ in range(steps)]
