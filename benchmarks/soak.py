"""A long NVE run with the default calculator: memory, re-recordings, energy drift.

    python benchmarks/soak.py [--model pet-demo-chgnet] [--steps 100000] [--seconds 540] [--out FILE.json]

Velocity Verlet (0.5 fs) of the 192-atom water box with ``TCPETCalculator(model)`` and no
other argument. Every ``--every`` steps it records the total energy, the GPU memory in use
and reserved, the Verlet-list rebuilds, neighbor-table widenings and CUDA-graph recordings,
and the wall time; it stops after ``--steps`` steps or ``--seconds`` seconds. Per-step times
show the accuracy watchdog's due steps (every ``watchdog.CALCULATOR_EVERY``-th, run eagerly
with every layer checked): their extra time over the median step, divided by the interval,
is the watchdog's cost at its default setting.
"""

from __future__ import annotations

import argparse
import json
import time

import _results
import numpy as np
import torch
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import water_box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pet-demo-chgnet")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=540.0)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/soak_<gpu>.json)")
    args = parser.parse_args()
    atoms = water_box(64, density=1.0, seed=0)
    calc = TCPETCalculator(args.model)
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    dyn = VelocityVerlet(atoms, 0.5 * fs)
    cuda = calc.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    dyn.run(1)
    sync()
    first_s = time.perf_counter() - start
    times, checked, records = [], [], []
    every, lean = calc.check_accuracy, calc._engine
    start = time.perf_counter()
    while dyn.nsteps < args.steps and time.perf_counter() - start < args.seconds:
        before = lean.evaluations if lean else 0
        t = time.perf_counter()
        dyn.run(1)
        sync()
        times.append(time.perf_counter() - t)
        if lean and every and any(e % every == 0 for e in range(before, lean.evaluations)):
            checked.append(len(times) - 1)  # a watchdog step
        if dyn.nsteps % args.every == 0:
            records.append(
                {
                    "step": dyn.nsteps,
                    "seconds": time.perf_counter() - start,
                    "e_total_eV": atoms.get_potential_energy() + atoms.get_kinetic_energy(),
                    "temperature_K": atoms.get_temperature(),
                    "allocated_GB": torch.cuda.memory_allocated() / 1e9 if cuda else None,
                    "reserved_GB": torch.cuda.memory_reserved() / 1e9 if cuda else None,
                    "list_rebuilds": lean.rebuilds if lean else None,
                    "widenings": lean.widenings if lean else None,
                    "graph_recordings": lean.recordings if lean else None,
                }
            )
            print(json.dumps(records[-1]), flush=True)
    ms = 1000 * np.array(times)
    median = float(np.median(ms))
    checked = ms[checked]
    energies = np.array([r["e_total_eV"] for r in records])
    result = {
        "model": args.model,
        "checkpoint_sha256": _results.checkpoint_digest(args.model),
        "calculator": repr(calc),
        "atoms": len(atoms),
        "timestep_fs": 0.5,
        "steps": dyn.nsteps,
        "first_step_s": first_s,
        "median_ms": median,
        "mean_ms": float(ms.mean()),
        "watchdog_every": calc.check_accuracy,
        "watchdog_step_ms": float(np.median(checked)) if len(checked) else None,
        "watchdog_cost_fraction": (float(np.median(checked)) - median) / (median * calc.check_accuracy)
        if len(checked)
        else None,
        "drift_meV_per_atom_per_ps": float(
            np.polyfit([r["step"] * 0.5e-3 for r in records], energies, 1)[0] / len(atoms) * 1000
        )
        if len(records) > 2
        else None,
        "records": records,
    }
    summary = {k: v for k, v in result.items() if k != "records"}
    print(json.dumps(summary, indent=1))
    _results.write("soak", [result], ("model", "atoms"), env=_results.environment(str(calc.device)), out=args.out)


if __name__ == "__main__":
    main()
