"""Multiple time stepping against velocity Verlet: simulated time per wall second, and drift.

    python benchmarks/mts.py [--model random-s] [--molecules 64,1000] [--inner-steps 4,8]
                             [--integrators mts,mts-ase] [--timestep-fs 0.5] [--steps 20] [--precision auto]
                             [--engine auto] [--drift-ps 0] [--device cuda] [--out FILE.json]

For each water box (3 atoms per molecule), runs velocity Verlet on the conservative forces
(ASE's ``VelocityVerlet``, one evaluation with the backward pass per step of
``--timestep-fs``) and :class:`ase_tcfp32.mts.MTSVelocityVerlet` with each ``--inner-steps``
M (inner steps of ``--timestep-fs``: per outer step M - 1 direct evaluations, forward
only, and one of both kinds), all through one ``TCPETCalculator``: ``mts`` with the inner steps
on the model's device (the default), ``mts-ase`` through ASE, one calculator call per inner
step (``device_inner_steps=False``). Prints per integrator the
median ms per (outer) step, the simulated ps per wall second, its ratio to velocity
Verlet's (the issue's target: >= 2 for M = 8), and the ms of one direct, one conservative
and one combined evaluation, which predict the ratio: ``M t_c / ((M - 1) t_d + t_both)``
(and of one pair-list build, which an outer step pays where the atoms have moved far enough;
on the device it is launched while the previous outer step's work runs).

``--model``: ``random-s`` / ``random-m`` (PET-MAD-S/-M shapes with random weights and
random direct heads: speed only), a uPET name or a checkpoint with direct heads.
``mts`` rows count the outer steps whose inner steps on the device were redone through ASE
(an atom moved out of the neighbor list's reach: random weights heat a box within steps);
every row on a lean engine the pair-list builds during its timed steps.
``--drift-ps T``: also runs each integrator for T ps after the timing and reports the
total energy's drift (slope of a straight-line fit, eV/ps, and per atom), and each MTS
drift over velocity Verlet's (the issue's physics check: <= 2 for M = 8 with the bundled
model's trained direct heads on 192 atoms, 0.5 fs inner step; a random model's direct
forces are not physical, its drift tells nothing). Writes its rows into
``benchmarks/results/mts_<gpu>.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import time
import warnings

import _results
import numpy as np
import torch
from _timing import md_step_times, timed
from ase import units
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._lean import LeanPET
from ase_tcfp32._neighbors import Structures
from ase_tcfp32.mts import MTSVelocityVerlet
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box

KEY = ("model", "atoms", "precision", "engine", "integrator", "inner_steps", "timestep_fs")
"""What identifies a row of the results file."""


def evaluation_ms(calc: TCPETCalculator, atoms, repeats: int = 10) -> dict:
    """Median ms of one direct (forward only), conservative and combined evaluation, and on
    the lean engines of one pair-list build."""
    sync = torch.cuda.synchronize if calc.device.type == "cuda" else (lambda: None)
    kinds = {
        "direct_ms": ["energy", "non_conservative_forces"],
        "conservative_ms": ["energy", "forces"],
        "both_ms": ["energy", "forces", "non_conservative_forces"],
    }
    times = {name: [] for name in kinds}
    for _ in range(2 + repeats):  # interleaved, the first two rounds discarded (warm-up, graph recording)
        for name, properties in kinds.items():
            sync()
            start = time.perf_counter()
            calc.evaluate([atoms], properties)
            sync()
            times[name].append(time.perf_counter() - start)
    out = {name: 1000 * float(np.median(t[2:])) for name, t in times.items()}
    if isinstance(calc._engine, LeanPET):
        out["pair_build_ms"] = pair_build_ms(calc._engine, atoms, repeats)
    return out


def pair_build_ms(engine: LeanPET, atoms, repeats: int) -> float:
    """Median ms of one rebuild of the lean ``engine``'s pair list for ``atoms``, into the
    buffers its recorded graphs read, as a step that needs one pays it."""
    batch = Structures.of([atoms])

    def build():
        if not engine.neighbors.update(batch, in_place=True):
            engine._graphs = {}  # new buffers: the recorded graphs are dropped, as LeanPET._use does

    return 1000 * float(np.median([timed(build) for _ in range(repeats)]))


def drift(dyn, atoms, picoseconds: float) -> float:
    """Total-energy drift (eV/ps) of ``dyn`` over ``picoseconds``: the slope of a
    straight line through the total energy after every step."""
    steps = max(2, round(picoseconds * 1000 * units.fs / dyn.dt))
    times, energies = [], []

    def record():
        times.append(dyn.get_time() / (1000 * units.fs))
        energies.append(atoms.get_potential_energy() + atoms.get_kinetic_energy())

    dyn.attach(record)
    dyn.run(steps)
    return float(np.polyfit(times, energies, 1)[0])


def measure(calc, atoms, integrator: str, inner: int, dt_fs: float, steps: int, drift_ps: float) -> dict:
    """One integrator's row: ms per (outer) step, simulated ps per wall second and, with
    ``drift_ps``, the total-energy drift."""
    atoms = atoms.copy()
    atoms.calc = calc
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    if integrator == "verlet":
        dyn = VelocityVerlet(atoms, dt_fs * units.fs)
    else:
        on_device = integrator == "mts"
        dyn = MTSVelocityVerlet(atoms, dt_fs * units.fs, inner_steps=inner, device_inner_steps=on_device)
    warmup = 3
    dyn.run(warmup)
    lean = isinstance(calc._engine, LeanPET)
    rebuilds = calc._engine.rebuilds if lean else 0
    times = md_step_times(dyn, steps)
    ms = 1000 * float(np.median(times))
    row = {"ms_per_step": ms, "ps_per_s": dyn.dt / (1000 * units.fs) / (ms / 1000)}
    if lean:  # the pair-list builds in the timed steps
        row["pair_rebuilds"] = calc._engine.rebuilds - rebuilds
    if integrator == "mts":
        row["redone_steps"] = dyn.redone_steps  # of the warm-up and timed steps (and the drift's, below)
    if drift_ps > 0:
        row["drift_eV_per_ps"] = drift(dyn, atoms, drift_ps)
        row["drift_meV_per_ps_atom"] = 1000 * row["drift_eV_per_ps"] / len(atoms)
        row["drift_ps"] = drift_ps
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-s", help="random-s, random-m, a uPET name or a checkpoint")
    parser.add_argument("--molecules", default="64,1000", help="water molecules per box (3 atoms each)")
    parser.add_argument("--inner-steps", default="4,8", help="M values for MTSVelocityVerlet")
    parser.add_argument("--integrators", default="mts", help="mts (inner steps on the device), mts-ase (through ASE)")
    parser.add_argument("--timestep-fs", type=float, default=0.5, help="velocity Verlet's and MTS's inner step")
    parser.add_argument("--steps", type=int, default=20, help="timed (outer) steps per integrator")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--device", default=None, help="default: CUDA when available")
    parser.add_argument("--drift-ps", type=float, default=0.0, help="also measure the energy drift over this time")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/mts_<gpu>.json)")
    args = parser.parse_args()
    model = random_checkpoint(args.model.removeprefix("random-")) if args.model.startswith("random-") else args.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = TCPETCalculator(model, precision=args.precision, device=args.device, engine=args.engine)
    print(repr(calc))
    env = _results.environment(str(calc.device))
    rows = []
    for molecules in map(int, args.molecules.split(",")):
        atoms = water_box(molecules, seed=0)
        calc.warm_up(atoms)
        cost = evaluation_ms(calc, atoms)
        print(
            f"{len(atoms)} atoms: one evaluation, direct {cost['direct_ms']:.2f} ms, conservative "
            f"{cost['conservative_ms']:.2f} ms, both {cost['both_ms']:.2f} ms"
            + (f"; one pair-list build {cost['pair_build_ms']:.2f} ms" if "pair_build_ms" in cost else "")
        )
        print(
            f"{'integrator':>10} {'M':>3} {'ms/step':>9} {'ps/s':>8} {'vs VV':>6} {'predicted':>9} {'drift eV/ps':>12}"
        )
        group = []
        kinds = [(kind, int(m)) for kind in args.integrators.split(",") for m in args.inner_steps.split(",")]
        for integrator, inner in [("verlet", 1), *kinds]:
            row = {
                "model": args.model,
                "atoms": len(atoms),
                "precision": calc.precision,
                "engine": calc.engine_used,
                "integrator": integrator,
                "inner_steps": inner,
                "timestep_fs": args.timestep_fs,
                **cost,
            }
            row.update(measure(calc, atoms, integrator, inner, args.timestep_fs, args.steps, args.drift_ps))
            verlet = group[0] if group else row
            row["speedup_vs_verlet"] = row["ps_per_s"] / verlet["ps_per_s"]
            row["predicted_speedup"] = (
                inner * cost["conservative_ms"] / ((inner - 1) * cost["direct_ms"] + cost["both_ms"])
                if integrator != "verlet"
                else 1.0
            )
            if "drift_eV_per_ps" in row:
                row["drift_vs_verlet"] = abs(row["drift_eV_per_ps"]) / max(abs(verlet["drift_eV_per_ps"]), 1e-300)
            group.append(row)
            drifted = f"{row['drift_eV_per_ps']:12.3e}" if "drift_eV_per_ps" in row else ""
            if "redone_steps" in row:
                drifted += f"  ({row['redone_steps']} outer steps redone through ASE)"
            if "pair_rebuilds" in row:
                drifted += f"  ({row['pair_rebuilds']} pair-list builds in {args.steps} steps)"
            print(
                f"{integrator:>10} {inner:>3} {row['ms_per_step']:9.2f} {row['ps_per_s']:8.4f} "
                f"{row['speedup_vs_verlet']:6.2f} {row['predicted_speedup']:9.2f} {drifted}",
                flush=True,
            )
            _results.write("mts", rows + group, KEY, env=env, out=args.out)
        rows += group
        if args.drift_ps > 0:
            print(
                "drift vs velocity Verlet:",
                ", ".join(f"M={r['inner_steps']} {r['drift_vs_verlet']:.2f}" for r in group[1:]),
            )


if __name__ == "__main__":
    main()
