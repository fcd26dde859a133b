"""What the validation tests share: calculators per precision, output files, tables."""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch

from ..calculator import TCPETCalculator
from ..models import load_pet
from ..testing import random_checkpoint


def resolve_model(model: str) -> str:
    """A checkpoint path for ``model``; ``"random:<shape>"`` builds a random-weight PET
    with PET-MAD shapes (``tiny``, ``xs``, ``s``, ``m``) for arithmetic-only checks."""
    if not model.startswith("random:"):
        return model
    return str(random_checkpoint(model.split(":", 1)[1]))


def calculator(model: str, precision: str, device: str | None, engine: str = "auto") -> TCPETCalculator:
    """A calculator for ``precision`` and ``engine``; ``"fp64"`` is the FP32 path on a float64
    model, always through the metatomic engine (the reference does not move with the engine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulation and fallback notes: the report says it
        if precision == "fp64":
            return TCPETCalculator(load_pet(model).to(torch.float64), precision="fp32", device=device)
        return TCPETCalculator(model, precision=precision, device=device, engine=engine)


def environment(device: str | None, engine: str | None = None) -> dict:
    """Versions and GPU of this run (and the calculator engine, when given)."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    if engine is not None:
        env["engine"] = engine
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        env["gpu"] = torch.cuda.get_device_name()
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["cuda"] = torch.version.cuda
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def run_jobs(function, tasks: list[tuple], jobs: int) -> list:
    """``[function(*task) for task in tasks]``, in ``jobs`` worker processes when > 1.

    Small-system MD on a GPU is bound by kernel launches on the host and leaves the GPU
    mostly idle, so independent trajectories run concurrently in separate processes
    (spawned: each has its own CUDA context). Per-step times are then not speeds. The
    workers share this process's CPU threads (each gets its share of
    ``torch.get_num_threads()``): on a CPU, workers that each took them all would
    oversubscribe the cores (two workers on 2 cores ran ~4x slower than one after the other).
    """
    if jobs <= 1 or len(tasks) <= 1:
        return [function(*task) for task in tasks]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = min(jobs, len(tasks))
    context = multiprocessing.get_context("spawn")
    threads = max(1, torch.get_num_threads() // workers)
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=torch.set_num_threads, initargs=(threads,)
    ) as pool:
        return list(pool.map(function, *zip(*tasks)))


def write(out: str | os.PathLike, name: str, results: dict, figure=None) -> dict:
    """Write ``<name>.json`` (and ``<name>.png``) into ``out``; return ``results``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"test": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **results}
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=float))
    if figure is not None:
        figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(figure)
    return results


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table; ``columns`` are (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [
        [("" if row.get(k) is None else format(row[k], f)) for k, _, f in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
