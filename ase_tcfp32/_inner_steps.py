"""The inner steps of multiple time stepping on the model's device, without the host.

An outer step of :mod:`ase_tcfp32.mts` makes M - 1 direct evaluations between two
conservative ones, each between a kick and a move of the atoms. Through ASE each is a round
trip: positions to the device, forces back, the host waiting for the device in between, and
ASE's and the calculator's host work on top; at 192 atoms that costs about as much as the
direct evaluation's kernels. Here the momenta and positions stay on the device (float64) for
all M inner steps: each direct evaluation replays the engine's recorded CUDA graph
(:meth:`ase_tcfp32._lean.LeanPET.direct_forces_on_device`), the host queues the whole loop and
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

Move = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``move(positions, momenta, k)``: the integrator's move over one inner step (the k-th of the
outer step) on device tensors [N, 3]: positions updated in place, the momenta returned."""


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
    positions (``forces_of``: :meth:`~ase_tcfp32._lean.LeanPET.direct_forces_on_device`'s
    function) and their half kick. None where an evaluation could not be trusted (module doc)."""
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
