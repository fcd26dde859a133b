"""Random-weight PET models with PET-MAD's shapes, for tests and benchmarks.

Their energies are not physical; their shapes, heads and arithmetic are PET-MAD's, which is
what speed and accuracy-against-FP64 measurements need when the real weights cannot be
downloaded.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .models import import_dependencies

PET_MAD_SHAPES = {
    # name: (d_pet, GNN layers, attention layers, cutoff Å, adaptive neighbors)
    "tiny": (16, 2, 1, 5.0, 16),
    "xs": (128, 2, 1, 7.5, 16),
    "s": (256, 3, 1, 8.0, 24),
    "m": (384, 3, 2, 8.5, 32),
}
"""PET-MAD v1.6 sizes (upet's model table) plus a tiny one for tests on CPU."""


def random_checkpoint(shape: str = "tiny", seed: int = 0) -> Path:
    """A saved :func:`random_pet` checkpoint in the temporary folder (made once)."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"ase-tcfp32-random-{shape}-{seed}.ckpt"
    if not path.exists():
        torch.save(random_pet(shape, seed=seed).get_checkpoint(), path)
    return path


def random_pet(shape: str = "tiny", *, seed: int = 0, atomic_types=tuple(range(1, 103))) -> torch.nn.Module:
    """A metatrain PET with random weights and the PET-MAD architecture rule.

    d_node = 4 d_pet, d_feedforward = 2 d_pet, d_head = d_pet, 8 heads (4 for tiny),
    RMSNorm, SwiGLU, PreLN, feedforward featurizer, Bump cutoff, and PET-MAD's three
    heads (energy, non-conservative force and stress). For tests and benchmarks of
    shapes and speed: its energies are not physical.
    """
    import_dependencies()
    from metatrain.pet import PET
    from metatrain.utils.architectures import get_default_hypers
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info, get_generic_target_info

    d_pet, gnn, attention, cutoff, neighbors = PET_MAD_SHAPES[shape]
    hypers = get_default_hypers("pet")["model"]
    hypers.update(
        d_pet=d_pet,
        d_node=4 * d_pet,
        d_head=d_pet,
        d_feedforward=2 * d_pet,
        num_heads=4 if shape == "tiny" else 8,
        num_gnn_layers=gnn,
        num_attention_layers=attention,
        cutoff=cutoff,
        num_neighbors_adaptive=neighbors,
        cutoff_function="Bump",
        cutoff_width=0.5,
        normalization="RMSNorm",
        activation="SwiGLU",
        transformer_type="PreLN",
        featurizer_type="feedforward",
    )
    targets = {
        "energy": get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"}),
        "non_conservative_force": get_generic_target_info(
            "non_conservative_force",
            {
                "quantity": "force",
                "unit": "eV/A",
                "type": {"cartesian": {"rank": 1}},
                "num_subtargets": 1,
                "sample_kind": "atom",
            },
        ),
        "non_conservative_stress": get_generic_target_info(
            "non_conservative_stress",
            {
                "quantity": "pressure",
                "unit": "eV/A^3",
                "type": {"cartesian": {"rank": 2}},
                "num_subtargets": 1,
                "sample_kind": "system",
            },
        ),
    }
    torch.manual_seed(seed)
    info = DatasetInfo(length_unit="Angstrom", atomic_types=list(atomic_types), targets=targets)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PET assumes that Cartesian tensors")
        return PET(hypers, info)
