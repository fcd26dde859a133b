"""What a user gets without knobs: the default calculator against the best configuration
and FP32's defaults, per MD step and to the first step, in fresh processes.

    python benchmarks/defaults.py [--systems s:64,s:5760,m:64] [--configs ...] [--steps 30] [--limit 600] [--out FILE.json]

For each system (PET-MAD-shaped model with random weights : water molecules) and each
configuration, a fresh Python process builds the calculator and runs ASE velocity Verlet
(neighbor-list updates included). Each configuration runs twice: first with empty cache
folders ("cold": ``ASE_TCFP32_CACHE``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``
all new, as on a fresh machine), then again with the caches the first run left ("warm": a
second process on the same machine). Python's bytecode cache is on in both, as after a
``pip install`` (``PYTHONDONTWRITEBYTECODE`` is dropped: without ``.pyc`` files, every
process spends seconds compiling torch's and metatrain's sources). Reported per row: the
time from the start of the process's work (imports excluded) to the first completed MD
step, and the median ms per step after it. Configurations: ``default`` (``TCPETCalculator(model)``), ``fp32-default``
(``precision="fp32"``, nothing else), and the candidates for ``best`` (engines, compiled or
not, in the default precision; the default among them) and for ``best-fp32`` (FP32's
defaults and compiled FP32 engines): the fastest steady step of each group is printed
against the default's. Rows go into ``benchmarks/results/defaults_<gpu>.json`` (``--out``:
elsewhere), replacing those of the same system and configuration. A process that runs past ``--limit`` seconds is stopped and its row says so.
Compiled configurations also report torch's cache counters (FX graph and AOTAutograd cache
hits, misses and bypasses): what a warm start still recompiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CANDIDATES = {
    "default": {},
    "fp32-default": {"precision": "fp32"},
    "metatomic": {"engine": "metatomic"},
    "metatomic+compile": {"engine": "metatomic", "compile": True},
    "lean": {"engine": "lean"},
    "lean+compile": {"engine": "lean", "compile": True},
    "graphs": {"engine": "graphs"},
    "graphs+compile": {"engine": "graphs", "compile": True},
    "fp32-metatomic+compile": {"precision": "fp32", "engine": "metatomic", "compile": True},
    "fp32-lean+compile": {"precision": "fp32", "engine": "lean", "compile": True},
    "fp32-graphs+compile": {"precision": "fp32", "engine": "graphs", "compile": True},
}
"""Calculator arguments per configuration name (``best``: the fastest in the default
precision, ``best-fp32``: the fastest in FP32)."""


def child(shape: str, molecules: int, kwargs: dict, steps: int) -> dict:
    """One configuration in this (fresh) process: seconds to the first MD step, median ms
    per step after a few more, peak GPU memory and, when compiled, torch's cache counters."""
    start = time.perf_counter()
    import numpy as np
    import torch
    from _timing import md_step_times
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    from ase_tcfp32 import TCPETCalculator
    from ase_tcfp32.testing import random_checkpoint
    from ase_tcfp32.validation import water_box

    imports = time.perf_counter() - start
    model = random_checkpoint(shape)
    start = time.perf_counter()
    calc = TCPETCalculator(model, **kwargs)
    atoms = water_box(molecules, seed=0)
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, 0.25 * fs)
    dyn.run(1)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    dyn.run(3)
    times = md_step_times(dyn, steps)
    row = {
        "precision": calc.precision,
        "engine": calc.engine,
        "compiled": calc.compiled,
        "repr": repr(calc),
        "ms": 1000 * float(np.median(times)),
        "first_s": first,
        "imports_s": imports,
        "peak_GB": torch.cuda.max_memory_allocated() / 1e9 if gpu else None,
    }
    if calc.compiled:
        from torch._dynamo.utils import counters

        row["torch_cache"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    return row


def measure(shape: str, molecules: int, name: str, steps: int, limit: float) -> dict:
    """``name``'s row: a cold process (empty caches), then a warm one (same caches), each
    stopped after ``limit`` seconds."""
    row = {"model": f"random-{shape}", "atoms": 3 * molecules, "config": name}
    with tempfile.TemporaryDirectory(prefix="tcfp32-defaults-") as folder:
        env = dict(
            os.environ,
            ASE_TCFP32_CACHE=f"{folder}/ase",
            TORCHINDUCTOR_CACHE_DIR=f"{folder}/inductor",
            TRITON_CACHE_DIR=f"{folder}/triton",
            PYTHONUNBUFFERED="1",
        )
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # Python's own .pyc caching, as users have it
        for run in ("cold", "warm"):
            args = [sys.executable, __file__, "--child", json.dumps([shape, molecules, CANDIDATES[name], steps])]
            try:
                done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                row[f"error_{run}"] = f"stopped after {limit:.0f} s (--limit)"
                break
            if done.returncode != 0:
                row[f"error_{run}"] = done.stderr[-1500:]
                break
            result = json.loads(done.stdout.strip().splitlines()[-1])
            row[f"first_s_{run}"] = result.pop("first_s")
            row.update(
                result if run == "cold" else {"ms_warm": result["ms"], "torch_cache_warm": result.get("torch_cache")}
            )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="s:64,s:5760,m:64", help="shape:water molecules, comma-separated")
    parser.add_argument("--configs", default=",".join(CANDIDATES), help="comma-separated names of CANDIDATES")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--limit", type=float, default=1800, help="seconds a configuration's process may run")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/defaults_<gpu>.json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    import _results

    rows = []

    def save(group):
        _results.write("defaults", rows + group, ("model", "atoms", "config"), out=args.out)

    print(
        f"{'model':>9} {'atoms':>6} {'config':>18} {'precision':>9} {'engine':>9} {'compiled':>8} {'ms':>8} "
        f"{'cold s':>7} {'warm s':>7}"
    )
    for system in args.systems.split(","):
        shape, molecules = system.split(":")
        group = []
        for name in args.configs.split(","):
            row = measure(shape, int(molecules), name, args.steps, args.limit)
            group.append(row)
            save(group)
            if "ms" in row:
                print(
                    f"{row['model']:>9} {row['atoms']:>6} {name:>18} {row['precision']:>9} {row['engine']:>9} "
                    f"{str(row['compiled']):>8} {row['ms']:8.1f} {row['first_s_cold']:7.1f} "
                    f"{row.get('first_s_warm', float('nan')):7.1f}",
                    flush=True,
                )
            else:
                print(f"{row['model']:>9} {row['atoms']:>6} {name:>18} failed: {row}", flush=True)
        timed = [r for r in group if "ms" in r]
        default = next((r for r in timed if r["config"] == "default"), None)
        for label, members in (
            ("best", [r for r in timed if r["precision"] != "fp32"]),
            ("best-fp32", [r for r in timed if r["precision"] == "fp32"]),
        ):
            if members:
                best = min(members, key=lambda r: r["ms"])
                if default:
                    print(
                        f"  {label}: {best['config']} {best['ms']:.1f} ms; default / {label}: {default['ms'] / best['ms']:.2f}"
                    )
        rows += group


if __name__ == "__main__":
    main()
