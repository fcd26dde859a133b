"""Random-weight PET models with PET-MAD's shapes, for tests and benchmarks.

Their energies are not physical; their shapes, heads and arithmetic are PET-MAD's, which is
what speed and accuracy-against-FP64 measurements need when the real weights cannot be
downloaded.
"""

from __future__ import annotations

import os
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
    return _saved(f"random-{shape}-{seed}", lambda: random_pet(shape, seed=seed))


def random_llpr_checkpoint(shape: str = "tiny", seed: int = 0, members: int = 8, direct: bool = True) -> Path:
    """A saved :func:`random_llpr` checkpoint in the temporary folder (made once)."""
    heads = None if direct else ("energy",)
    return _saved(
        f"random-llpr-{shape}-{seed}-{members}{'' if direct else '-energy-only'}",
        lambda: random_llpr(shape, seed=seed, members=members, heads=heads),
    )


def _saved(name: str, make) -> Path:
    """``ase-tcfp32-<name>.ckpt`` in the temporary folder, the checkpoint of the model ``make()``
    saved there the first time: written whole or not at all, for concurrent test runs."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"ase-tcfp32-{name}.ckpt"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.part")
        torch.save(make().get_checkpoint(), partial)
        os.replace(partial, path)
    return path


def random_llpr(
    shape: str = "tiny", *, seed: int = 0, members: int = 8, heads=None, structures: int = 8
) -> torch.nn.Module:
    """:func:`random_pet` (water's elements) wrapped in metatrain's ``LLPRUncertaintyModel``,
    with ensembles of ``members`` members of each of ``heads`` (default all three: the
    energy and the direct force and stress heads), made by metatrain's own methods as its
    LLPR trainer does: the covariance of the last-layer features over ``structures`` small
    water boxes whose targets are the model's own predictions plus noise (0.01 eV, 0.05 eV/Å,
    0.001 eV/Å³), its Cholesky factor (regularized by 0.01: a few boxes do not span the
    features), the calibration (squared residuals) and the ensembles' weights. Float32,
    like the releases. For tests and examples of the LLPR outputs: its numbers are not
    physical. About a second on a CPU."""
    import_dependencies()
    from metatensor.torch import Labels, TensorBlock, TensorMap
    from metatomic.torch import ModelOutput, systems_to_torch
    from metatrain.llpr import LLPRUncertaintyModel
    from metatrain.utils.architectures import get_default_hypers
    from metatrain.utils.data import Dataset
    from metatrain.utils.neighbor_lists import get_requested_neighbor_lists, get_system_with_neighbor_lists

    from .validation import water_box

    pet = random_pet(shape, seed=seed, atomic_types=[1, 8]).eval()
    boxes = [water_box(2 + k % 3, seed=seed + k) for k in range(structures)]
    lists = get_requested_neighbor_lists(pet)
    systems = [get_system_with_neighbor_lists(system, lists) for system in systems_to_torch(boxes)]
    targets = pet.dataset_info.targets
    with torch.no_grad():
        predicted = pet(
            systems, {name: ModelOutput(sample_kind=target.sample_kind) for name, target in targets.items()}
        )
    noise = {"energy": 0.01, "non_conservative_force": 0.05, "non_conservative_stress": 0.001}
    generator = torch.Generator().manual_seed(seed)
    data = {"system": systems_to_torch(boxes, dtype=torch.float64)}
    for name, tensor in predicted.items():
        block = tensor.block()
        values = block.values.double() + noise[name] * torch.randn(block.values.shape, generator=generator).double()
        data[name] = []
        for k in range(len(boxes)):
            rows = block.samples.column("system") == k
            samples = Labels(block.samples.names, block.samples.values[rows])
            data[name].append(
                TensorMap(tensor.keys, [TensorBlock(values[rows], samples, block.components, block.properties)])
            )
    dataset = Dataset.from_dict(data)
    hypers = get_default_hypers("llpr")["model"]
    hypers["num_ensemble_members"] = {name: members for name in (heads or targets)}
    model = LLPRUncertaintyModel(hypers, pet.dataset_info)
    model.set_wrapped_model(pet)
    model = model.to(torch.float64)
    model.compute_covariance([dataset], 2, is_distributed=False)
    model.compute_cholesky_decomposition(regularizer=0.01)
    model.calibrate([dataset], 2, is_distributed=False, calibration_method="squared_residuals")
    model.generate_ensemble()
    return model.to(torch.float32)


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
