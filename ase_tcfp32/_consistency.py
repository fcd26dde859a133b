"""upet's and metatomic-ase's ``check_consistency``: every evaluation's inputs and outputs
checked, for debugging (slower).

metatomic checks what goes into and comes out of an exported model (shapes, units,
neighbor lists). The lean engines build PET's inputs themselves, from a Verlet list kept
across steps, so here each evaluation checks (:func:`check`) that the list holds every
pair within the model's cutoff, searched afresh on the CPU (a stale list would silently
drop neighbors), and that every result is finite and has its shape. The metatomic engine
passes the flag to metatomic-ase, which runs metatomic's own checks.
"""

from __future__ import annotations

import numpy as np
from ase import Atoms

from ._neighbors import Structures, missing_pairs

SHAPES = {"energies": ("n",), "forces": ("n", 3), "stress": (3, 3), "non_conservative_forces": ("n", 3)}
"""The shapes of the per-structure results that are checked ("n": the structure's atoms)."""


class ConsistencyError(RuntimeError):
    """An evaluation's inputs or outputs are not what they must be (``check_consistency``)."""


def check(engine, structures: list[Atoms], results: list[dict]) -> None:
    """Raise :class:`ConsistencyError` where ``engine``'s last evaluation of ``structures``
    missed a pair within the model's cutoff (lean engines) or gave ``results`` that are not
    finite or not of their shapes."""
    neighbors = getattr(engine, "neighbors", None)  # the lean engines' Verlet list
    if neighbors is not None and neighbors.pairs is not None:
        missing = missing_pairs(neighbors.pairs, Structures.of(structures), neighbors.cutoff)
        if missing:
            raise ConsistencyError(
                f"the engine's neighbor list lacks {missing} pair(s) within the model's cutoff of "
                f"{neighbors.cutoff:g} Å (Verlet skin {neighbors.skin:g} Å)"
            )
    for k, (atoms, result) in enumerate(zip(structures, results, strict=True)):
        for name, value in result.items():
            value = np.asarray(value)
            if not np.isfinite(value).all():
                raise ConsistencyError(f"structure {k}: {name} is not finite")
            shape = tuple(len(atoms) if size == "n" else size for size in SHAPES.get(name, value.shape))
            if value.shape != shape:
                raise ConsistencyError(f"structure {k}: {name} has shape {value.shape}, not {shape}")
