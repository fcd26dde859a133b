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
    random and shifted by up to 0.2 Å (centres stay >= 2.7 Å apart at 1 g/cm³).
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
        centre = (site + 0.5) * spacing + rng.uniform(-0.2, 0.2, 3)
        positions.extend(rotated + centre)
        symbols.extend(template.get_chemical_symbols())
    atoms = Atoms(symbols, positions=positions, cell=[length] * 3, pbc=True)
    atoms.wrap()
    return atoms
