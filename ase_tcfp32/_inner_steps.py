"""The inner steps of multiple time stepping on the model's device, without the host.

An outer step of :mod:`ase_tcfp32.mts` makes M - 1 direct evaluations between two
conservative ones, each between a kick and a move of the atoms. Through ASE each is a round
trip: positions to the device, forces back, the host waiting for the device in between, and
ASE's and the calculator's host work on top; at 192 atoms that costs about as much as the
direct evaluation's kernels. Here the momenta and positions stay on the device (float64) for
all M inner steps: each direct evaluation replays the lean engine's recorded CUDA graph
(:func:`direct_forces_on_device`), the host queues the whole loop and
waits once, at the end, for the positions, the momenta and one flag. The flag says whether an
evaluation could not be trusted (an atom more than half the neighbor list's skin from where
the list was built, or one that outgrew the neighbor table): then nothing is kept and the
outer step is redone through ASE from where it started, the list rebuilt there.

The arithmetic is the ASE path's, in the same order, so both give the same trajectory to
rounding (``tests/test_mts.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from ase import Atoms

from ._heads import FORCE
from ._lean import LeanPET
from ._neighbors import Structures

INNER_REACH = 0.25
"""Before evaluations without the host, the fraction of the skin an atom may have moved since
the pairs were built: the rest is room for the moves of the evaluations that follow (an outer
step of multiple time stepping: ~0.1-0.3 Å for water's hydrogens in 4 fs at 300 K, against
half of the 2 Å skin that CUDA graphs use)."""

Move = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``move(positions, momenta, k)``: the integrator's move over one inner step (the k-th of the
outer step) on device tensors [N, 3]: positions updated in place, the momenta returned."""


def direct_forces_on_device(engine: LeanPET, structures: list[Atoms]) -> Callable | None:
    """The lean ``engine``'s pairs made current for ``structures`` (rebuilt already where an
    atom has moved :data:`INNER_REACH` of the skin), and a function that evaluates them at other
    positions without the host: from positions [N, 3] (Å, float64, on the device) it returns
    the direct forces [N, 3] (eV/Å, float64, on the device; a recorded graph's buffer,
    overwritten by its next replay) and a bool tensor, true where the evaluation cannot be
    trusted: an atom more than half the skin from where the pairs were built, or one that
    outgrew the neighbor table (the kept pairs the packed rows). Nothing waits for the device.
    None before the engine's first evaluation of the system (which sizes the table). Reaches
    into the engine's step (``_use``, ``_evaluate``) as its ``compute`` does, minus the host."""
    batch = Structures.of(structures)
    engine._use(batch, INNER_REACH)
    if engine.width == 0:
        return None
    cells = torch.from_numpy(batch.cells).to(engine.device, engine.dtype)
    reference = torch.from_numpy(engine.neighbors.reference).to(engine.device, torch.float64)
    reach, width, rows = (0.5 * engine.skin) ** 2, engine.width, engine.rows
    flags = {"grad": False, "stress": False, "direct": (FORCE,), "llpr": (), "energy": False}  # nothing else read

    def forces(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = engine._evaluate(
            positions.to(engine.dtype), cells, engine.numbers, engine.system, engine.unweighted, flags
        )
        most, total = flat.tensor("sizes")
        moved = (positions - reference).pow(2).sum(1).max()
        return flat.tensor("non_conservative_forces"), (moved > reach) | (most > width) | (total > rows)

    return forces


def run(
    forces_of: Callable,
    momenta: np.ndarray,
    positions: np.ndarray,
    direct: np.ndarray,
    timestep: float,
    steps: int,
    move: Move,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The positions and momenta [N, 3] after ``steps`` inner steps (of ``timestep``, ASE
    time units) from ``momenta`` (after the outer step's slow half kick, amu·Å/ASE time),
    ``positions`` (Å) and the ``direct`` forces there (eV/Å): each step a half kick of the
    direct forces, the ``move``, and, except after the last, the direct forces at the new
    positions (``forces_of``: :func:`direct_forces_on_device`'s function) and their half
    kick. None where an evaluation could not be trusted (module doc)."""
    p, x, f = (torch.tensor(array, dtype=torch.float64, device=device) for array in (momenta, positions, direct))
    untrusted = torch.zeros((), dtype=torch.bool, device=device)
    for k in range(steps):
        p = p + 0.5 * timestep * f
        p = move(x, p, k)
        if k < steps - 1:
            f, flag = forces_of(x)
            untrusted = untrusted | flag
            p = p + 0.5 * timestep * f
    if bool(untrusted):  # the one wait for the device
        return None
    return x.cpu().numpy(), p.cpu().numpy()
