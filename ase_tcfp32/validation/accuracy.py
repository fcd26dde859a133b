"""Accuracy of a calculator against reference-labelled structures, per family."""

from __future__ import annotations

import numpy as np


def against_labels(calc, frames, family_key: str = "family") -> dict:
    """Energy MAE (meV/atom) and force MAE (meV/Å) of ``calc`` on labelled ``frames``.

    ``frames`` carry their reference energy and forces (e.g. read from an extxyz file)
    and a family name in ``atoms.info[family_key]``; returns ``{family: metrics}``.
    """
    table = {}
    for family in sorted({f.info[family_key] for f in frames}):
        de, df = [], []
        for ref in (f for f in frames if f.info[family_key] == family):
            atoms = ref.copy()
            atoms.calc = calc
            de.append(abs(atoms.get_potential_energy() - ref.get_potential_energy()) / len(atoms))
            df.append(np.abs(atoms.get_forces() - ref.get_forces()).ravel())
        table[family] = {
            "structures": len(de),
            "energy_mae_meV_atom": 1000 * float(np.mean(de)),
            "force_mae_meV_A": 1000 * float(np.mean(np.concatenate(df))),
        }
    return table
