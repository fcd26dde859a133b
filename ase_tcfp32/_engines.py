"""The engines that evaluate a prepared PET, their one interface, and the choice among them.

Every engine implements :class:`Engine`: ``compute(structures, properties)`` returns one
dict of results per structure. :func:`make_engine` builds the one a calculator asked for
(``engine="auto"``: :func:`choose_engine`) with its neighbor-list skin and CUDA-graph policy:

- ``"lean"``: :class:`ase_tcfp32._lean.LeanPET`, the model on plain tensors with static
  shapes (on packed rows where our attention runs);
- ``"graphs"``: the same, its step recorded as a CUDA graph and replayed;
- ``"metatomic"``: :class:`ase_tcfp32._metatomic.MetatomicEngine`, metatomic-ase's
  calculator around the exported model.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Protocol

import torch
from ase import Atoms

from ._heads import LLPR, Heads
from ._lean import LeanPET, unsupported_reason
from ._memory import pieces_for
from ._packed import unsupported_reason as packed_problem

PROPERTIES = ("energy", "energies", "forces", "stress")
"""What an engine computes by default: energies, and forces and stress by autograd."""

DIRECT = ("non_conservative_forces", "non_conservative_stress")
"""What else :meth:`Engine.compute` may be asked for: the direct heads' forces and stress
(and :data:`ase_tcfp32._uncertainty.LLPR_OUTPUTS`)."""


class Engine(Protocol):
    """What the calculator asks of an engine."""

    def compute(self, structures: list[Atoms], properties: Collection[str], weights: list | None = None) -> list[dict]:
        """Per structure, float64 results in ASE units: ``energy`` (eV) and ``energies``
        [n] (eV); ``forces`` [n, 3] (eV/Å) when ``"forces"`` or ``"stress"`` is among
        ``properties`` (an energy-only call runs no backward pass); ``stress`` [3, 3]
        (eV/Å³, positive under tension) of each 3D-periodic structure when ``"stress"`` is;
        and, when asked (:data:`DIRECT`), the direct heads' ``non_conservative_forces``
        [n, 3] and ``non_conservative_stress`` [3, 3] (3D-periodic structures).

        ``weights``, one array [n] per structure, makes ``energy`` the weighted sum of the
        per-atom energies and ``forces`` and ``stress`` its derivatives (``energies`` stay
        unweighted): a domain's owned atoms weighted 1 and its halo 0
        (:mod:`ase_tcfp32.lammps`)."""


ENGINES = ("auto", "metatomic", "lean", "graphs")
"""How the calculator evaluates the model (see :class:`ase_tcfp32.TCPETCalculator`)."""

GRAPH_ATOMS = 8192
"""``engine="auto"`` replays CUDA graphs for systems (or batches) up to this many atoms.
Small systems are bound by kernel launches, which a graph removes (192 water atoms, PET-S
shape, fp16x3 on an H200: 8.5 ms per MD step against 68.9 ms through metatomic-ase; 32 beads
of it, 6,144 atoms, through i-PI: 137.0 ms per step against 154.9 ms with plain launches);
large ones keep the GPU busy anyway, and a graph would only hold its memory (17,280 atoms,
same run, skin 2 Å: 137.5 ms per conservative step and 61.4 ms per direct one with a graph,
137.6 and 62.1 without; not measured between 6,144 and 17,280 atoms)."""

SMALL_SKIN, LARGE_SKIN = 2.0, 0.5
"""``engine="auto"``'s Verlet skin (Å) for systems whose step replays a CUDA graph (up to
:data:`GRAPH_ATOMS` atoms) and for the others (larger systems, and every system on a CPU):
a graph's step costs its kernel count, not its pairs, and a wide skin rebuilds the list
rarely; elsewhere every candidate pair costs work (17,280 water atoms: 2 Å holds ~2x the
pairs of the cutoff sphere; 192 atoms on a CPU, lean engine, interleaved runs: 0.5 Å a few
percent faster per MD step than 2 Å with the demo model and PET-S, rebuilds included)."""


def choose_engine(pet: torch.nn.Module, device: torch.device, low_memory: bool) -> tuple[str, str]:
    """What ``engine="auto"`` runs for this model on ``device``, and why, in words."""
    reason = unsupported_reason(pet)
    if reason is not None:
        return "metatomic", f"the lean engine cannot evaluate this model ({reason})"
    return choose_engine_for(device, low_memory)


def choose_engine_for(device: torch.device | str, low_memory: bool = False) -> tuple[str, str]:
    """:func:`choose_engine` for a model the lean engine can evaluate (PET-MAD and the uPETs)."""
    if torch.device(device).type != "cuda":
        return "lean", (
            f"the model on plain tensors, neighbor skin {LARGE_SKIN} Å: on a CPU as fast per step as "
            "metatomic-ase and about twice as quick to its first step (docs/usage.md)"
        )
    if low_memory:
        return "lean", f"low_memory=True: recomputed layers, no CUDA graphs, neighbor skin {LARGE_SKIN} Å"
    return "lean", (
        f"CUDA graphs for systems up to {GRAPH_ATOMS} atoms (neighbor skin {SMALL_SKIN} Å), "
        f"plain launches above (skin {LARGE_SKIN} Å)"
    )


def check_engine(engine: str, device: torch.device, low_memory: bool) -> None:
    """A clear error for an engine that cannot run as asked (before any model is loaded)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "graphs" and low_memory:
        raise ValueError("low_memory=True is not supported with engine='graphs' (graphs are for small systems)")
    if engine == "graphs" and device.type != "cuda":
        raise ValueError(f"engine='graphs' records CUDA graphs and needs a CUDA device, not '{device}'")


def make_engine(
    pet: torch.nn.Module,
    device: torch.device,
    engine: str = "auto",
    *,
    neighbor_skin: float | None = None,
    low_memory: bool = False,
    compile: bool = False,
    check_every: int = 0,
    packed: bool = False,
    heads: Heads | None = None,
    piece_atoms: int | None = 0,
    check_consistency: bool = False,
    llpr: LLPR | None = None,
) -> tuple[Engine, str, str]:
    """The engine ``engine`` (one of :data:`ENGINES`) for the prepared ``pet`` on ``device``,
    the name of the one it runs, and why, in words.

    :param neighbor_skin: Verlet skin (Å); default :data:`SMALL_SKIN`, and with
        ``engine="auto"`` :data:`SMALL_SKIN` where the step replays a CUDA graph and
        :data:`LARGE_SKIN` elsewhere.
    :param packed: PET's attention runs on our kernels: the lean engines evaluate it on
        packed rows (:mod:`ase_tcfp32._packed`) unless the model is compiled.
    :param heads: which of the model's outputs to read (:class:`ase_tcfp32._heads.Heads`:
        variants, direct heads; default: the default energy and whichever direct heads exist).
    :param piece_atoms: evaluate large systems in pieces, one GNN layer at a time, on packed
        rows (:func:`ase_tcfp32._memory.pieces_for`: None automatic, 0 never, N > 0 above N
        atoms); lean engines only.
    :param check_consistency: metatomic's checks of the model's inputs and outputs (the
        metatomic engine; the calculator checks the lean engines', :mod:`ase_tcfp32._consistency`).
    :param llpr: the checkpoint's LLPR, for :data:`ase_tcfp32._uncertainty.LLPR_OUTPUTS` (None:
        the model has none).
    """
    check_engine(engine, device, low_memory)
    used, reason = choose_engine(pet, device, low_memory) if engine == "auto" else (engine, "chosen by the caller")
    replays = engine == "auto" and device.type == "cuda" and not low_memory
    pair_bound = engine == "auto" and not replays  # a CPU, low_memory: every candidate pair costs work
    skin = (LARGE_SKIN if pair_bound else SMALL_SKIN) if neighbor_skin is None else neighbor_skin
    if used == "metatomic":
        if piece_atoms:
            raise ValueError(f"piece_atoms={piece_atoms}: pieces are evaluated by the lean engines, not 'metatomic'")
        from ._metatomic import MetatomicEngine

        variants = heads.variants if heads else None
        return MetatomicEngine(pet, device, skin, variants, llpr, check_consistency, heads), used, reason
    graph_atoms, large_skin = (sys.maxsize if used == "graphs" else 0), None
    if replays:
        graph_atoms, large_skin = GRAPH_ATOMS, (LARGE_SKIN if neighbor_skin is None else neighbor_skin)
    whole = "compile=True" if compile else packed_problem(pet)  # why packed rows cannot evaluate it, or None
    if piece_atoms and whole:
        raise ValueError(f"piece_atoms={piece_atoms}: pieces need packed rows, which cannot be used: {whole}")
    pieces = pieces_for(pet, device, piece_atoms, low_memory) if (packed or piece_atoms) and not whole else None
    lean = LeanPET(
        pet,
        device,
        skin,
        graph_atoms,
        large_skin,
        compile=compile,
        check_every=check_every,
        packed=(packed or pieces is not None) and not whole,
        heads=heads,
        pieces=pieces,
        llpr=llpr,
    )
    return lean, used, reason
