"""Accuracy of the bundled demo PET against its teacher, and its MD/relaxation behaviour.

    python scripts/demo_model/evaluate.py --test build/demo-model/test.xyz --merge-into docs/demo_model.json
    # or in parts, e.g. two processes: --parts test,relax --out a.json / --parts nve,mts --device cuda --out b.json

Per family of the held-out test set: energy MAE (meV/atom) and force MAE (meV/Å) against
the CHGNet labels; NVE of the 192-atom water box in FP32 (drift, no blow-up); FIRE
relaxation of a Cantor-alloy slab to fmax 1e-3 eV/Å; with ``--parts direct``, per family of
the test set, the RMS of the direct heads' forces and stress against the model's own
conservative ones (``ase_tcfp32.validation.accuracy.direct_against_conservative``); with
``--parts mts``, the same water box's total-energy drift over ``--mts-ps``, relaxed and
started near 300 K, with velocity
Verlet and with multiple time stepping (:class:`ase_tcfp32.mts.MTSVelocityVerlet`, the
direct forces in the inner steps) at M = 2, 4 and 8, 0.5 fs inner steps. Everything in FP32
on ``--device`` (default the CPU: the model card's figures unless it says otherwise).
"""

import argparse
import json
import time

import numpy as np
from ase.io import read
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.optimize import FIRE
from ase.units import fs

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.mts import MTSVelocityVerlet
from ase_tcfp32.validation import cantor_slab, water_box
from ase_tcfp32.validation.accuracy import against_labels, direct_against_conservative


def water_at_300_k(calc):
    """The 192-atom water box (seed 0) on ``calc``, momenta from 300 K (seed 0), no net momentum:
    where the NVE and multiple-time-stepping runs start."""
    atoms = water_box(64, seed=0)
    atoms.calc = calc
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    return atoms


def relaxed_water_at_300_k(calc):
    """The same box relaxed (FIRE to 0.05 eV/Å), momenta from 600 K (seed 0), no net momentum:
    equipartition halves that to ~300 K within ~0.1 ps, so runs start near equilibrium (the
    box as built relaxes and heats to ~500 K within 0.25 ps)."""
    atoms = water_at_300_k(calc)
    FIRE(atoms, logfile=None).run(fmax=0.05, steps=1000)
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(0))
    Stationary(atoms)
    return atoms


def nve(calc, ps: float) -> dict:
    atoms = water_at_300_k(calc)
    dyn = VelocityVerlet(atoms, 0.5 * fs)
    t, e, temps = [], [], []

    def record():
        t.append(dyn.nsteps * 0.5e-3)
        e.append(atoms.get_total_energy() / len(atoms))
        temps.append(atoms.get_temperature())

    dyn.attach(record, interval=20)
    start = time.perf_counter()
    dyn.run(int(ps * 2000))
    slope = float(np.polyfit(t, e, 1)[0])
    return {
        "ps": ps,
        "drift_eV_atom_ps": slope,
        "max_dev_eV_atom": float(np.ptp(e)),
        "mean_T_K": float(np.mean(temps)),
        "max_T_K": float(np.max(temps)),
        "finite": bool(np.all(np.isfinite(e))),
        "s_per_step": (time.perf_counter() - start) / (ps * 2000),
    }


def energy_drift(dyn, ps: float) -> dict:
    """``dyn`` run for ``ps`` picoseconds: its atoms' total-energy drift (eV/ps, a straight
    line's slope over every step), its span (eV) and the final temperature (K)."""
    atoms, t, e = dyn.atoms, [], []
    dyn.attach(lambda: (t.append(dyn.get_time() / (1000 * fs)), e.append(atoms.get_total_energy())))
    dyn.run(round(ps * 1000 * fs / dyn.dt))
    return {
        "ps": ps,
        "drift_eV_ps": float(np.polyfit(t, e, 1)[0]),
        "span_eV": float(np.ptp(e)),
        "T_end_K": float(atoms.get_temperature()),
    }


def mts(calc, ps: float) -> dict:
    """Per M (1: velocity Verlet, conservative forces; 2, 4, 8: multiple time stepping), the
    192-atom water box's total-energy drift (eV/ps, a straight line's slope), its span (eV)
    and the final temperature, from the same relaxed ~300 K start, 0.5 fs (inner) steps."""
    rows = {}
    start = relaxed_water_at_300_k(calc)
    for inner in (1, 2, 4, 8):
        atoms = start.copy()
        atoms.calc = calc
        dyn = VelocityVerlet(atoms, 0.5 * fs) if inner == 1 else MTSVelocityVerlet(atoms, 0.5 * fs, inner_steps=inner)
        rows[inner] = energy_drift(dyn, ps)
        print(inner, rows[inner], flush=True)
    return rows


def relax(calc) -> dict:
    atoms = cantor_slab(seed=0)
    atoms.rattle(0.05, seed=0)
    atoms.calc = calc
    opt = FIRE(atoms, logfile=None)
    converged = opt.run(fmax=1e-3, steps=2000)
    return {
        "atoms": len(atoms),
        "converged": bool(converged),
        "steps": opt.nsteps,
        "final_fmax": float(np.linalg.norm(atoms.get_forces(), axis=1).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pet-demo-chgnet")
    parser.add_argument("--test", required=True)
    parser.add_argument("--nve-ps", type=float, default=10.0)
    parser.add_argument("--mts-ps", type=float, default=0.25)
    parser.add_argument("--parts", default="test,relax,nve", help="comma-separated: test, relax, nve, direct, mts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge-into", default=None, help="a JSON file whose keys the results replace")
    args = parser.parse_args()
    calc = TCPETCalculator(args.model, precision="fp32", device=args.device, uncertainty_threshold=None)
    results = {"model": args.model, "device": str(calc.device)}
    parts = args.parts.split(",")
    if "test" in parts:
        results["test_set"] = against_labels(calc, read(args.test, ":"))
        print(json.dumps(results["test_set"], indent=1), flush=True)
    if "direct" in parts:
        results["direct_heads"] = direct_against_conservative(calc, read(args.test, ":"))
        print(json.dumps(results["direct_heads"], indent=1), flush=True)
    if "relax" in parts:
        results["relax"] = relax(calc)
        print(results["relax"], flush=True)
    if "nve" in parts:
        results["nve"] = nve(calc, args.nve_ps)
        print(results["nve"], flush=True)
    if "mts" in parts:
        results["mts"] = mts(calc, args.mts_ps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.merge_into:
        with open(args.merge_into) as f:
            card = json.load(f)
        card.update(results)
        with open(args.merge_into, "w") as f:
            json.dump(card, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
