"""What to tell a user whose system did not fit in the GPU's memory.

The estimate comes from the memory one energy + forces evaluation of the default engine
(packed rows) takes per atom of liquid water, measured on an H200 (``python
benchmarks/memory.py --models s,m --precisions fp16x3 --per-atom 2880,5760``: the peak's
slope between 8,640 and 17,280 atoms), scaled to the model's width and depth, and from the
share of the GPU's memory a large evaluation can use (the caching allocator keeps some
reserved and unallocated): measured, the largest PET-S water boxes that fit in the H200's
150 GB are 78,000-80,436 atoms by default and 131,625-136,500 with ``low_memory=True``
(``python benchmarks/memory.py --models s --precisions fp16x3 --largest --start 26000``).
"""

from __future__ import annotations

import torch

PER_ATOM = {
    # (d_pet, GNN layers, attention layers per GNN layer): bytes per atom (default, low_memory)
    (256, 3, 1): (1.611e6, 0.926e6),  # PET-S shape
    (384, 3, 2): (5.055e6, 2.457e6),  # PET-M shape
}
"""Peak bytes per water atom of an energy + forces evaluation, H200, fp16x3, packed rows."""

USABLE = 0.84
"""The share of a GPU's memory the largest evaluations used (78,000 atoms x 1.611 MB of the
H200's 150.1 GB by default, 131,625-136,500 x 0.926 MB with low_memory)."""


def bytes_per_atom(pet: torch.nn.Module, low_memory: bool) -> float:
    """Peak bytes per atom of ``pet`` (metatrain PET): the measured shape nearest in width x
    GNN layers x attention layers, scaled by that product."""
    backend = pet.backend
    size = backend.d_pet * len(backend.gnn_layers) * pet.hypers.get("num_attention_layers", 1)
    shape = min(PER_ATOM, key=lambda s: abs(s[0] * s[1] * s[2] - size))
    return PER_ATOM[shape][bool(low_memory)] * size / (shape[0] * shape[1] * shape[2])


PIECE_SHARE = 0.04
"""The share of a GPU's memory that one piece's activations may take when a system is
evaluated in pieces (:mod:`ase_tcfp32._layerwise`): the rest holds the whole system's
per-row tensors."""


def pieces_for(pet: torch.nn.Module, device: torch.device, piece_atoms: int | None, low_memory: bool):
    """When to evaluate a system in pieces (:class:`ase_tcfp32._layerwise.Pieces`, or None:
    never): ``piece_atoms`` > 0, systems of more atoms than that in pieces of that many; 0,
    never; None, on a GPU, systems larger than fit whole (:func:`largest_system`) in pieces
    whose one GNN layer's activations take :data:`PIECE_SHARE` of its memory (on a CPU,
    never). On a GPU, systems of up to :data:`KEEP` of the largest that fits in pieces keep
    each layer's outputs (faster)."""
    from ._layerwise import Pieces

    if piece_atoms == 0 or (piece_atoms is None and device.type != "cuda"):
        return None
    if device.type != "cuda":
        return Pieces(piece_atoms, piece_atoms)
    memory = torch.cuda.get_device_properties(device).total_memory
    keep = int(KEEP * largest_in_pieces(pet, memory))
    if piece_atoms is not None:
        return Pieces(piece_atoms, piece_atoms, keep)
    per_layer = bytes_per_atom(pet, False) / len(pet.backend.gnn_layers)
    size = max(1024, int(PIECE_SHARE * memory / per_layer))
    return Pieces(largest_system(pet, memory, low_memory), size, keep)


PIECES = 0.359e6 / 1.611e6
"""Peak bytes per atom of an evaluation in pieces against a whole one's (default settings,
PET-S shape: 111.7 GB at 311,040 water atoms on an H200, which 466,560 did not fit in;
``python benchmarks/pieces.py``)."""


KEEP = 0.8
"""The share of the largest system that fits in pieces up to which each layer's outputs are
kept (two more per-pair tensors with three GNN layers against the five at the peak and
the pairs)."""


def largest_in_pieces(pet: torch.nn.Module, memory: int) -> int:
    """About how many atoms of water-like density fit in ``memory`` bytes of a GPU in pieces."""
    return int(USABLE * memory / (PIECES * bytes_per_atom(pet, False)))


def largest_system(pet: torch.nn.Module, memory: int, low_memory: bool) -> int:
    """About how many atoms of water-like density fit in ``memory`` bytes of a GPU."""
    return int(USABLE * memory / bytes_per_atom(pet, low_memory))


def out_of_memory_message(pet: torch.nn.Module, atoms: int, memory: int, gpu: str, low_memory: bool) -> str:
    """What to say when ``atoms`` atoms of metatrain ``pet`` did not fit in the ``memory``
    bytes of GPU ``gpu``: the estimated largest system, and what else to try."""
    backend = pet.backend
    fits = largest_system(pet, memory, low_memory)
    hint = (
        ""
        if low_memory
        else f" With low_memory=True (each GNN layer recomputed in the backward pass) about "
        f"{largest_system(pet, memory, True):,} would."
    )
    hint += f" In pieces (piece_atoms, the default past that size) about {largest_in_pieces(pet, memory):,}."
    return (
        f"{atoms:,} atoms did not fit in the {memory / 1e9:.0f} GB of {gpu} with this model (d_pet "
        f"{backend.d_pet}, {len(backend.gnn_layers)} GNN layers). Estimated largest system here: about {fits:,} "
        f"atoms at the density of liquid water (measured per atom on an H200, docs/performance.md).{hint} "
        "Smaller systems, or several GPUs through i-PI for many structures (docs/scaling.md), are the other ways out."
    )
