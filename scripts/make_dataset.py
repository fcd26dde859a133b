"""Make the training data of the bundled demo PET, labelled by CHGNet (r2SCAN model).

    python -m venv /tmp/teacher && /tmp/teacher/bin/pip install chgnet -e .
    /tmp/teacher/bin/python scripts/make_dataset.py --out data/      # ~10 min on 2 cores

The teacher ships inside its PyPI package (``chgnet/pretrained/r2scan``), so this runs
offline; it is not a dependency of ase-tcfp32. Every structure is seeded. Families:
water (compressed to expanded boxes, short 300-500 K Langevin runs), CO and its fragments
on Pt(111) at many heights (the 1.2-6.0 Å pull-off included), CoCrFeMnNi bulk and fcc(111)
slabs (rattled, strained), and a little diversity (Pt bulk, molecules in vacuum).
Writes ``train.xyz``, ``val.xyz``, ``test.xyz`` (80/10/10 per family, energy in eV,
forces in eV/Å, stress where 3D-periodic) with the family in ``atoms.info["family"]``.

A last family, ``contacts`` (metal atoms closer than in any of the above: compressed and
strongly rattled Cantor and Pt cells, single pairs pushed to 1.7-2.3 Å), goes to
``contacts-{train,val,test}.xyz``: the model trained without it pulled Cr-Cr pairs to
1.05 Å in slab relaxations; stage 3 of ``scripts/train_demo_model.sh`` trains on it.
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

from ase_tcfp32.validation import cantor_slab, co_on_pt111, water_box


def teacher():
    from chgnet.model import CHGNet, CHGNetCalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CHGNetCalculator(CHGNet.load(model_name="r2scan", verbose=False), use_device="cpu")


def label(atoms: Atoms, calc, family: str) -> Atoms:
    atoms = atoms.copy()
    atoms.calc = calc
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    stress = atoms.get_stress() if atoms.pbc.all() else None
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.info["family"] = family
    atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
    return atoms


def water(calc, rng) -> list[Atoms]:
    frames = []
    for i, (n_mol, density, temperature, steps) in enumerate(
        [
            (64, 1.0, 300, 24),
            (64, 0.95, 400, 24),
            (64, 1.0, 350, 24),
            (32, 1.0, 350, 40),
            (32, 1.08, 300, 40),
            (32, 0.9, 400, 40),
            (32, 1.0, 300, 40),
            (32, 1.03, 330, 40),
            (16, 1.0, 400, 60),
            (16, 0.95, 300, 60),
            (64, 1.0, 300, 48),
            (64, 1.02, 330, 48),
            (64, 0.98, 370, 48),
            (32, 1.0, 300, 80),
            (32, 0.97, 450, 80),
            (16, 1.05, 350, 80),
            (16, 1.0, 500, 80),
        ]
    ):
        atoms = water_box(n_mol, density=density, seed=100 + i)
        atoms.calc = calc
        thermalize_momenta(atoms, temperature_K=temperature, rng=rng)
        dyn = Langevin(atoms, 1.0 * fs, temperature_K=temperature, friction=0.05, fixcm=False, rng=rng)
        for _ in range(steps // 4):
            dyn.run(4)
            frames.append(label(atoms, calc, "water"))
    return frames


def co_pt(calc, rng) -> list[Atoms]:
    frames = []
    for h in np.linspace(1.0, 6.5, 45):
        frames.append(label(co_on_pt111(h), calc, "co-pt111"))
    for _ in range(45):
        atoms = co_on_pt111(rng.uniform(1.2, 4.0))
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        atoms.positions[-1] += rng.normal(scale=0.15, size=3)  # tilt and stretch CO
        frames.append(label(atoms, calc, "co-pt111"))
    for symbol in ("C", "O"):
        for h in np.linspace(0.9, 4.0, 15):
            atoms = co_on_pt111(h)
            del atoms[-1 if symbol == "C" else -2]
            frames.append(label(atoms, calc, "co-pt111"))
    return frames


def _cantor_cell(a: float, rng) -> Atoms:
    """A 32-atom cubic fcc cell (lattice constant ``a`` Å) of CoCrFeMnNi, species shuffled."""
    atoms = bulk("Ni", "fcc", a=a, cubic=True) * (2, 2, 2)
    symbols = np.array(["Co", "Cr", "Fe", "Mn", "Ni"] * 7)[:32]
    rng.shuffle(symbols)
    atoms.set_chemical_symbols(symbols.tolist())
    return atoms


def cantor(calc, rng) -> list[Atoms]:
    frames = []
    for i in range(60):
        atoms = _cantor_cell(3.59 * rng.uniform(0.97, 1.03), rng)
        atoms.set_cell(atoms.cell @ (np.eye(3) + rng.normal(scale=0.01, size=(3, 3))), scale_atoms=True)
        atoms.rattle(0.08, seed=i)
        frames.append(label(atoms, calc, "cantor"))
    for i in range(40):
        atoms = cantor_slab(size=(4, 4, 6), seed=i)
        atoms.rattle(rng.uniform(0.0, 0.1), seed=i)
        frames.append(label(atoms, calc, "cantor"))
    for i in range(6):
        atoms = cantor_slab(seed=i)
        atoms.rattle(0.03, seed=i)
        frames.append(label(atoms, calc, "cantor"))
    return frames


def diversity(calc, rng) -> list[Atoms]:
    frames = []
    for i in range(30):
        atoms = bulk("Pt", "fcc", a=3.92 * rng.uniform(0.96, 1.04), cubic=True) * (2, 2, 2)
        atoms.rattle(0.06, seed=i)
        frames.append(label(atoms, calc, "other"))
    for i, name in enumerate(["H2O", "CO", "CO2", "H2", "O2", "CH4", "CH3OH", "H2O2"] * 10):
        atoms = molecule(name)
        atoms.rattle(0.02 + 0.01 * (i // 8), seed=i)
        atoms.center(vacuum=5.0)
        frames.append(label(atoms, calc, "other"))
    return frames


def _push_pair(atoms: Atoms, rng, distance: float, prefer: str | None = None) -> Atoms:
    """Move a random atom and its nearest neighbor symmetrically to ``distance`` Å apart."""
    candidates = [i for i, s in enumerate(atoms.get_chemical_symbols()) if prefer in (None, s)]
    i = int(rng.choice(candidates))
    d = atoms.get_distances(i, range(len(atoms)), mic=True, vector=True)
    r = np.linalg.norm(d, axis=1)
    r[i] = np.inf
    if prefer is not None:  # nearest neighbor of the same species when there is one close by
        same = [j for j, s in enumerate(atoms.get_chemical_symbols()) if s == prefer and r[j] < 3.2]
        j = min(same, key=lambda j: r[j]) if same else int(np.argmin(r))
    else:
        j = int(np.argmin(r))
    shift = (r[j] - distance) / 2 * d[j] / r[j]
    atoms.positions[i] += shift
    atoms.positions[j] -= shift
    return atoms


def contacts(calc, rng) -> list[Atoms]:
    frames = []
    for i in range(25):  # compressed Cantor bulk
        atoms = _cantor_cell(3.59 * rng.uniform(0.86, 0.95), rng)
        atoms.rattle(0.08, seed=1000 + i)
        frames.append(label(atoms, calc, "contacts"))
    for i in range(25):  # strongly rattled Cantor bulk
        atoms = _cantor_cell(3.59, rng)
        atoms.rattle(rng.uniform(0.15, 0.3), seed=2000 + i)
        frames.append(label(atoms, calc, "contacts"))
    for i in range(40):  # Cantor slabs with one pair pushed together, Cr-Cr half of the time
        atoms = cantor_slab(size=(4, 4, 6), seed=100 + i)
        atoms.rattle(0.05, seed=3000 + i)
        _push_pair(atoms, rng, rng.uniform(1.7, 2.3), prefer="Cr" if i % 2 == 0 else None)
        frames.append(label(atoms, calc, "contacts"))
    for i in range(20):  # Cantor bulk with one pair pushed together
        atoms = _cantor_cell(3.59, rng)
        atoms.rattle(0.05, seed=4000 + i)
        _push_pair(atoms, rng, rng.uniform(1.7, 2.3), prefer="Cr" if i % 2 == 0 else None)
        frames.append(label(atoms, calc, "contacts"))
    for i in range(20):  # Pt: compressed bulk, and slabs with a pair pushed together
        if i % 2 == 0:
            atoms = bulk("Pt", "fcc", a=3.92 * rng.uniform(0.88, 0.95), cubic=True) * (2, 2, 2)
            atoms.rattle(0.1, seed=5000 + i)
        else:
            atoms = co_on_pt111(rng.uniform(1.8, 4.0))
            atoms.rattle(0.05, seed=5000 + i)
            _push_pair(atoms, rng, rng.uniform(2.0, 2.5), prefer="Pt")
        frames.append(label(atoms, calc, "contacts"))
    return frames


MAX_FORCE = 40.0
"""eV/Å: structures with larger forces (CO pressed to 1.0-1.1 Å from Pt) are left out so
that a few extreme repulsions do not dominate the squared-error loss."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    calc = teacher()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for prefix, families in (("", (co_pt, cantor, diversity, water)), ("contacts-", (contacts,))):
        splits = {"train": [], "val": [], "test": []}
        for make in families:
            frames = [f for f in make(calc, rng) if np.abs(f.get_forces()).max() <= MAX_FORCE]
            order = rng.permutation(len(frames))
            n_val = n_test = max(1, len(frames) // 10)
            splits["test"] += [frames[i] for i in order[:n_test]]
            splits["val"] += [frames[i] for i in order[n_test : n_test + n_val]]
            splits["train"] += [frames[i] for i in order[n_test + n_val :]]
            print(f"{make.__name__}: {len(frames)} structures", flush=True)
        for name, frames in splits.items():
            write(out / f"{prefix}{name}.xyz", frames, format="extxyz")
            print(f"{prefix}{name}: {len(frames)} structures, {sum(len(f) for f in frames)} atoms")


if __name__ == "__main__":
    main()
