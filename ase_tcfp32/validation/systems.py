"""Seeded builders of the systems the validation suite and the examples use."""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.build import molecule
from scipy.spatial.transform import Rotation

_WATER_MASS_G = 18.015 / 6.02214076e23


def water_box(n_molecules: int = 64, density: float = 1.0, seed: int = 0) -> Atoms:
    """Periodic cubic box of randomly oriented H2O on a jittered cubic lattice.

    ``density`` in g/cm³; 64 molecules (192 atoms) at 1 g/cm³ is a 12.42 Å box.
    Molecules are placed on the smallest n³ lattice holding them, rotated at
    random and shifted by up to 0.2 Å (centers stay >= 2.7 Å apart at 1 g/cm³).
    """
    rng = np.random.default_rng(seed)
    length = (n_molecules * _WATER_MASS_G / density) ** (1 / 3) * 1e8  # cm -> Å
    per_side = int(np.ceil(n_molecules ** (1 / 3) - 1e-9))
    spacing = length / per_side
    sites = np.array([(i, j, k) for i in range(per_side) for j in range(per_side) for k in range(per_side)])
    sites = sites[rng.permutation(len(sites))[:n_molecules]]
    template = molecule("H2O")
    template.positions -= template.get_center_of_mass()
    positions, symbols = [], []
    for site in sites:
        rotated = Rotation.random(random_state=rng).apply(template.positions)
        center = (site + 0.5) * spacing + rng.uniform(-0.2, 0.2, 3)
        positions.extend(rotated + center)
        symbols.extend(template.get_chemical_symbols())
    atoms = Atoms(symbols, positions=positions, cell=[length] * 3, pbc=True)
    atoms.wrap()
    return atoms


def co_on_pt111(height: float, size: tuple[int, int, int] = (3, 3, 4), vacuum: float = 10.0) -> Atoms:
    """CO upright on the top site of a Pt(111) slab, C ``height`` Å above the top Pt.

    C-O bond 1.15 Å, O pointing away from the surface; the slab is periodic in-plane.
    """
    from ase.build import add_adsorbate, fcc111

    slab = fcc111("Pt", size=size, a=3.92, vacuum=vacuum, periodic=False)
    slab.pbc = (True, True, False)
    co = Atoms("CO", positions=[(0, 0, 0), (0, 0, 1.15)])
    add_adsorbate(slab, co, height=height, position="ontop")
    return slab


CANTOR = {"Co": 108, "Cr": 108, "Fe": 108, "Mn": 107, "Ni": 108}
"""Species counts of the 539-atom Cantor-alloy slab of the reference study."""


def cantor_slab(size: tuple[int, int, int] = (7, 7, 11), seed: int = 0, counts: dict | None = None) -> Atoms:
    """An fcc(111) slab of CoCrFeMnNi with a seeded random arrangement of the species.

    The default 7 x 7 x 11 slab has 539 atoms, Co108Cr108Fe108Mn107Ni108; other sizes
    share the atoms out as evenly as possible. Lattice constant 3.59 Å, 10 Å vacuum,
    periodic in-plane.
    """
    from ase.build import fcc111

    slab = fcc111("Ni", size=size, a=3.59, vacuum=10.0, periodic=False)
    slab.pbc = (True, True, False)
    n = len(slab)
    if counts is None:
        counts = CANTOR if n == sum(CANTOR.values()) else {s: n // 5 + (i < n % 5) for i, s in enumerate(CANTOR)}
    symbols = [s for s, c in counts.items() for _ in range(c)]
    if len(symbols) != n:
        raise ValueError(f"species counts {counts} do not add up to the {n} atoms of the slab")
    np.random.default_rng(seed).shuffle(symbols)
    slab.set_chemical_symbols(symbols)
    return slab
