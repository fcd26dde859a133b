"""Timing helpers shared by the benchmarks (run from this folder: ``python benchmarks/x.py``)."""

from __future__ import annotations

import time

import torch


def md_step_times(dyn, steps: int) -> list[float]:
    """Seconds of each of ``steps`` steps of the ASE dynamics ``dyn``, the GPU (if any)
    synchronised before and after each: what the step costs the host and the device."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        dyn.run(1)
        sync()
        times.append(time.perf_counter() - start)
    return times
