"""The steps of multiple time stepping on the model's device, without the host.

An outer step of :mod:`ase_tcfp32.mts` makes M - 1 direct evaluations between two
conservative ones, each between a kick and a move of the atoms. Through ASE each is a round
trip: positions to the device, forces back, the host waiting for the device in between, and
ASE's and the calculator's host work on top; at 192 atoms that costs about as much as the
direct evaluation's kernels. Here the momenta and positions stay on the device (float64) for
all M inner steps and the outer evaluation at their end: each evaluation replays the lean
engine's recorded CUDA graph (:func:`evaluations_on_device`), the host queues the whole
loop and waits once, at the end, for one copy of the positions, the momenta, the outer
evaluation's results and a flag. The flag says whether an evaluation could not be trusted
(an atom more than half the neighbor list's skin from where the list was built, or one
that outgrew the neighbor table): then nothing is kept and the outer step is redone
through ASE from where it started, the list rebuilt there.

Where an atom has moved half of :data:`INNER_REACH` of the skin when an outer step starts,
the neighbor list is rebuilt at its end, for the next one: launched on the device after the
outer evaluation (:meth:`ase_tcfp32._neighbors.VerletList.rebuilder`, small periodic cells
on a GPU) while the device still works through the inner steps, its pair count read with
the rest. Built at the start of the next outer step instead, the host's launches would leave
the device idle (0.8 ms at 192 water atoms on an H100, every other outer step at M = 8).

The arithmetic is the ASE path's, in the same order, so both give the same trajectory to
rounding (``tests/test_mts.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from ase import Atoms

from ._heads import FORCE
from ._lean import LeanPET
from ._neighbors import Structures, uploaded
from ._results import per_structure

INNER_REACH = 0.25
"""Before evaluations without the host, the fraction of the skin an atom may have moved since
the pairs were built: the rest is room for the moves of the evaluations that follow (an outer
step of multiple time stepping: ~0.1-0.3 Å for water's hydrogens in 4 fs at 300 K, against
half of the 2 Å skin that CUDA graphs use)."""

Move = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``move(positions, momenta, k)``: the integrator's move over one inner step (the k-th of the
outer step) on device tensors [N, 3]: positions updated in place, the momenta returned."""


class Evaluations(NamedTuple):
    """An outer step's evaluations on the device, from positions [N, 3] (Å, float64, on the
    device) to a bool tensor, true where the evaluation cannot be trusted (module doc), and
    their results, a recorded graph's buffers (overwritten by its next replay)."""

    direct: Callable  # positions -> (the direct forces [N, 3], eV/Å, float64; flag)
    outer: Callable  # positions -> (the outer evaluation's results, a Flat; flag)
    structures: list[Atoms]  # the structures evaluated (the outer results are split into theirs)
    rebuild: Callable | None  # positions -> pair count: the pairs rebuilt there, queued (VerletList.rebuilder)
    settle: Callable  # (pair count or None, host positions) after the wait (VerletList.settle)


def evaluations_on_device(engine: LeanPET, structures: list[Atoms], outer: set[str]) -> Evaluations | None:
    """The lean ``engine``'s pairs made current for ``structures`` (rebuilt already where an
    atom has moved :data:`INNER_REACH` of the skin), and its evaluations at other positions
    without the host: the direct forces alone (the inner steps), and the engine properties
    ``outer`` (what the calculator asks of it at an outer step). Nothing waits for the
    device. None before the engine's first evaluation of the system (which sizes the table).
    Reaches into the engine's step (``_use``, ``_evaluate``) as its ``compute`` does, minus
    the host."""
    batch = Structures.of(structures)
    engine._use(batch, INNER_REACH)
    if engine.width == 0:
        return None
    cells = uploaded(batch.cells, engine.device, engine.dtype)
    reference = torch.from_numpy(engine.neighbors.reference).to(engine.device, torch.float64)
    reach, width, rows = (0.5 * engine.skin) ** 2, engine.width, engine.rows
    direct = {"grad": False, "stress": False, "direct": (FORCE,), "llpr": (), "energy": False}  # nothing else read
    both = engine.flags(structures, outer)
    due = engine.neighbors.stale(batch, INNER_REACH / 2)  # likely stale by the end of this outer step
    rebuild = engine.neighbors.rebuilder(batch) if due else None

    def evaluated(positions: torch.Tensor, flags: dict) -> tuple:
        flat = engine._evaluate(
            positions.to(engine.dtype), cells, engine.numbers, engine.system, engine.unweighted, flags
        )
        most, total = flat.tensor("sizes")
        moved = (positions - reference).pow(2).sum(1).max()
        return flat, ~(moved <= reach) | (most > width) | (total > rows)  # NaN positions are not trusted either

    def forces(positions: torch.Tensor) -> tuple:
        flat, untrusted = evaluated(positions, direct)
        return flat.tensor("non_conservative_forces"), untrusted

    outer_evaluation = functools.partial(evaluated, flags=both)
    return Evaluations(forces, outer_evaluation, structures, rebuild, engine.neighbors.settle)


def run(
    evaluations: Evaluations,
    momenta: np.ndarray,
    positions: np.ndarray,
    direct: np.ndarray,
    timestep: float,
    steps: int,
    move: Move,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """The positions and momenta [N, 3] after ``steps`` inner steps (of ``timestep``, ASE
    time units) from ``momenta`` (after the outer step's slow half kick, amu·Å/ASE time),
    ``positions`` (Å) and the ``direct`` forces there (eV/Å): each step a half kick of the
    direct forces, the ``move``, and, except after the last, the direct forces at the new
    positions and their half kick; then the outer evaluation at the final positions, as
    the engine's ``compute`` gives it for the evaluations' (one) structure. None where an
    evaluation could not be trusted (module doc)."""
    p, x, f = (torch.tensor(array, dtype=torch.float64, device=device) for array in (momenta, positions, direct))
    untrusted = torch.zeros((), dtype=torch.bool, device=device)
    for k in range(steps):
        p = p + 0.5 * timestep * f
        p = move(x, p, k)
        if k < steps - 1:
            f, flag = evaluations.direct(x)
            untrusted = untrusted | flag
            p = p + 0.5 * timestep * f
    outer, flag = evaluations.outer(x)
    ends = {"untrusted": untrusted | flag, "positions": x, "momenta": p}
    if evaluations.rebuild is not None:  # the next outer step's pairs, launched while the device works
        ends["pairs"] = evaluations.rebuild(x)
    host = outer.plus(ends).to_host()  # the one wait
    x, p, untrusted = host.pop("positions"), host.pop("momenta"), bool(host.pop("untrusted"))
    if "pairs" in host:  # kept for the next outer step, not for a redone one
        evaluations.settle(None if untrusted else int(host.pop("pairs")), x)
    if untrusted:
        return None
    host.pop("sizes")
    return x, p, per_structure(host, evaluations.structures)[0]
