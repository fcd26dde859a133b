"""Out-of-distribution structures for the demo PET's uncertainty figures (seeded).

    TEACHER_PYTHON scripts/demo_model/ood_structures.py --out build/demo-model/ood.xyz [--no-teacher]

Structures unlike any of the demo model's training data (``scripts/make_dataset.py``), in
families named in ``atoms.info["family"]``, each labelled with the CHGNet r2SCAN teacher
(energy, forces; so that the figures can compare the predicted uncertainty with the real
error) unless ``--no-teacher``:

- ``compressed``: CoCrFeMnNi and Pt fcc cells at 80% of the lattice constant (the training
  data stop at 86%), water at 1.6 g/cm³ (training: 0.9-1.08);
- ``expanded``: the same cells at 115% of the lattice constant, water at 0.6 g/cm³;
- ``new-arrangement``: elements the model knows in arrangements it never saw: bcc
  CoCrFeMnNi, PtO rocksalt, Pt hydride (H in every octahedral site), a CO2/CH4 molecular
  crystal... (see ``arrangements``);
- ``hot-melt``: 32-atom Cantor and Pt cells after 300 Langevin steps at 5000 K with the
  demo model itself (atoms far off their lattice sites, short pairs);
- ``random-gas``: 24 H, C, O atoms at random positions in a 10 Å box (no pair under 0.9 Å).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.build import bulk, molecule
from ase.io import write
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import thermalize_momenta
from ase.units import fs

from ase_tcfp32.validation import water_box


def cantor_cell(a: float, rng, crystal: str = "fcc") -> Atoms:
    atoms = bulk("Ni", crystal, a=a, cubic=True) * ((2, 2, 2) if crystal == "fcc" else (3, 3, 2))
    symbols = np.array(["Co", "Cr", "Fe", "Mn", "Ni"] * 8)[: len(atoms)]
    rng.shuffle(symbols)
    atoms.set_chemical_symbols(symbols.tolist())
    return atoms


def pt_cell(a: float) -> Atoms:
    return bulk("Pt", "fcc", a=a, cubic=True) * (2, 2, 2)


def strained(scale: float, water_density: float, rng, seed: int) -> list[Atoms]:
    frames = [cantor_cell(3.59 * scale, rng), pt_cell(3.92 * scale), water_box(16, density=water_density, seed=seed)]
    for i, atoms in enumerate(frames):
        atoms.rattle(0.02, seed=seed + i)
    return frames


def arrangements(rng) -> list[Atoms]:
    frames = [cantor_cell(2.87, rng, "bcc")]  # bcc CoCrFeMnNi (the alloy is fcc)
    rocksalt = bulk("PtO", "rocksalt", a=4.6, cubic=True) * (2, 2, 1)  # a Pt oxide structure
    frames.append(rocksalt)
    hydride = bulk("Pt", "fcc", a=4.05, cubic=True) * (2, 2, 1)  # H in every octahedral site
    for position in hydride.get_positions():
        hydride += Atoms("H", positions=[position + [hydride.cell[0, 0] / 4, 0, 0]])
    hydride.wrap()
    frames.append(hydride)
    crystal = Atoms(cell=[7.0, 7.0, 7.0], pbc=True)  # CO2 and CH4 packed in a small cell
    for name, shift in (
        ("CO2", (1.5, 1.5, 1.5)),
        ("CH4", (5.0, 5.0, 1.5)),
        ("CO2", (5.0, 1.5, 5.0)),
        ("CH4", (1.5, 5.0, 5.0)),
    ):
        mol = molecule(name)
        mol.positions += shift
        crystal += mol
    frames.append(crystal)
    chain = Atoms("Pt8", positions=[[2.4 * i, 0, 0] for i in range(8)], cell=[19.2, 10, 10], pbc=[True, False, False])
    frames.append(chain)  # a monatomic Pt wire
    benzene = molecule("C6H6")
    benzene.center(vacuum=5.0)
    frames.append(benzene)
    for i, atoms in enumerate(frames):
        atoms.rattle(0.02, seed=300 + i)
    return frames


def hot_melt(rng) -> list[Atoms]:
    from ase_tcfp32 import TCPETCalculator

    calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu")
    frames = []
    for start in (cantor_cell(3.59, rng), pt_cell(3.92)):
        atoms = start.copy()
        atoms.calc = calc
        thermalize_momenta(atoms, temperature_K=5000, rng=rng)
        Langevin(atoms, 1.0 * fs, temperature_K=5000, friction=0.05, rng=rng).run(300)
        frames.append(Atoms(atoms.get_chemical_symbols(), atoms.get_positions(), cell=atoms.cell, pbc=True))
    return frames


def random_gas(rng, n: int = 24, box: float = 10.0) -> Atoms:
    positions: list[np.ndarray] = []
    while len(positions) < n:
        p = rng.uniform(0, box, size=3)
        if all(np.linalg.norm(p - q) > 0.9 for q in positions):
            positions.append(p)
    return Atoms(rng.choice(["H", "C", "O"], size=n).tolist(), positions=positions, cell=[box] * 3, pbc=False)


def structures(seed: int = 0) -> list[Atoms]:
    rng = np.random.default_rng(seed)
    families = {
        "compressed": strained(0.80, 1.6, rng, 100),
        "expanded": strained(1.15, 0.6, rng, 200),
        "new-arrangement": arrangements(rng),
        "hot-melt": hot_melt(rng),
        "random-gas": [random_gas(rng) for _ in range(3)],
    }
    frames = []
    for family, members in families.items():
        for atoms in members:
            atoms.info["family"] = family
            frames.append(atoms)
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-teacher", action="store_true")
    args = parser.parse_args()
    frames = structures(args.seed)
    if not args.no_teacher:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from make_dataset import label, teacher

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calc = teacher()
            frames = [label(atoms, calc, atoms.info["family"]) for atoms in frames]
    write(args.out, frames, format="extxyz")
    print(f"{args.out}: {len(frames)} structures, {sum(len(a) for a in frames)} atoms")


if __name__ == "__main__":
    main()
