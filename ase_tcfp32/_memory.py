"""What to tell a user whose system did not fit in the GPU's memory."""

from __future__ import annotations

import torch


def out_of_memory_message(pet: torch.nn.Module, atoms: int, memory: int, gpu: str, low_memory: bool) -> str:
    """What to say when ``atoms`` atoms of metatrain ``pet`` did not fit in the ``memory``
    bytes of GPU ``gpu``: the estimated largest system, and what else to try. The estimate
    scales the largest water boxes measured on an H200 (139 GB, eager, docs/performance.md:
    PET-S shape, d_pet 256 with 3 GNN x 1 attention layers, 49,152 atoms and 82,944 with
    ``low_memory``; PET-M shape, d_pet 384 with 3 x 2, 15,360 and 32,256) by width x depth."""
    backend = pet.backend
    attention = pet.hypers.get("num_attention_layers", 1)
    per_atom = 139e9 / 49_152 * (backend.d_pet / 256) * len(backend.gnn_layers) / 3 * attention
    fits = int(memory / per_atom)
    hint = (
        ""
        if low_memory
        else f" With low_memory=True (each GNN layer recomputed in the backward pass) about {int(fits * 1.7):,} would."
    )
    return (
        f"{atoms:,} atoms did not fit in the {memory / 1e9:.0f} GB of {gpu} with this model (d_pet "
        f"{backend.d_pet}, {len(backend.gnn_layers)} GNN layers). Estimated largest system here: about {fits:,} "
        f"atoms (from the water boxes measured on an H200, docs/performance.md).{hint} Smaller systems, or "
        "several GPUs through i-PI for many structures (docs/scaling.md), are the other ways out."
    )
