"""Molecular dynamics of a 192-atom water box: Langevin NVT, then NVE, with a trajectory.

    python examples/md_water.py                      # the bundled demo PET (see below)
    python examples/md_water.py --model pet-mad-s    # PET-MAD-S (downloads once)
    python examples/md_water.py --model my.ckpt --precision tf32x3 --nvt 2000 --nve 2000
    python examples/md_water.py --engine graphs --compile   # fastest steady state on a GPU (slow first step)

Without --model it uses ``pet-demo-chgnet``, the small PET shipped with the package:
distilled from CHGNet (r2SCAN) for water, CO/Pt(111) and CoCrFeMnNi, it is a demo model,
not PET-MAD (accuracy in docs/demo_model.md). Every code path (loading, precision swap,
neighbor lists, forces, ASE dynamics) is the one PET-MAD takes.
"""

import argparse
import warnings

import numpy as np
from ase.io.trajectory import Trajectory
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import water_box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="pet-demo-chgnet", help="uPET name or checkpoint path (default: the bundled demo PET)"
    )
    parser.add_argument("--precision", default="auto", help="auto, fp32, tf32, tf32x3, fp16x3, bf16x9")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)")
    parser.add_argument("--nvt", type=int, default=20, help="Langevin steps at 300 K")
    parser.add_argument("--nve", type=int, default=20, help="velocity Verlet steps after NVT")
    parser.add_argument("--traj", default="water.traj", help="trajectory file (every 5 steps)")
    parser.add_argument("--engine", default="auto", help="auto, metatomic, lean, graphs (CUDA): see docs/usage.md")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (slow first step)")
    args = parser.parse_args()

    model = args.model
    # uncertainty_threshold: warn when an atom's energy uncertainty exceeds it. The demo model's
    # per-atom uncertainty is ~0.3 eV in distribution (up to ~0.6 eV on water's oxygens,
    # docs/demo_model.md), above upet's 0.1 eV default that suits PET-MAD: 0.7 eV for it.
    threshold = 0.7 if model == "pet-demo-chgnet" else 0.1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        calc = TCPETCalculator(
            model,
            precision=args.precision,
            device=args.device,
            engine=args.engine,
            compile=args.compile,
            uncertainty_threshold=threshold,
        )
    for warning in caught:
        print(f"note: {warning.message}")
    print(calc)

    atoms = water_box(64, density=1.0, seed=0)
    atoms.calc = calc
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    # the one-off work (kernel compilation, GEMM tuning, compile=True) before the first step
    print(f"warm-up: {calc.warm_up(atoms):.1f} s")
    trajectory = Trajectory(args.traj, "w", atoms)
    print(f"{len(atoms)} atoms, 0.5 fs, {args.nvt} NVT + {args.nve} NVE steps, precision {calc.precision}")
    print(f"{'phase':>5} {'step':>6} {'E_pot (eV)':>14} {'E_kin (eV)':>12} {'E_tot (eV)':>14} {'T (K)':>8}")

    for phase, dyn in [
        ("NVT", Langevin(atoms, 0.5 * fs, temperature_K=300, friction=0.02, fixcm=False, rng=np.random.default_rng(1))),
        ("NVE", VelocityVerlet(atoms, timestep=0.5 * fs)),
    ]:
        steps = args.nvt if phase == "NVT" else args.nve

        def report(dyn=dyn, phase=phase):
            e_pot, e_kin = atoms.get_potential_energy(), atoms.get_kinetic_energy()
            print(
                f"{phase:>5} {dyn.nsteps:6d} {e_pot:14.6f} {e_kin:12.6f} {e_pot + e_kin:14.6f} {atoms.get_temperature():8.1f}"
            )

        dyn.attach(report, interval=max(1, steps // 5))
        dyn.attach(trajectory.write, interval=5)
        dyn.run(steps)
    trajectory.close()
    print(f"trajectory: {args.traj}")


if __name__ == "__main__":
    main()
