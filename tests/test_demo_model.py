"""The bundled demo PET: loads by name with no network, keeps its documented accuracy, has
PET-MAD's direct force and stress heads (documented closeness to its own conservative forces,
FP32-accurate on tensor cores) and carries PET-MAD's LLPR uncertainty (energy uncertainty and
ensemble)."""

import hashlib
import warnings
from pathlib import Path

import numpy as np
import pytest
from ase.io import read
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from ase_tcfp32 import TCPETCalculator, known_models
from ase_tcfp32.models import bundled_checkpoint
from ase_tcfp32.validation import water_box
from ase_tcfp32.validation.accuracy import against_labels, direct_against_conservative

TEST_SET = Path(__file__).parent / "data" / "demo_model" / "test.xyz"

DOCUMENTED = {  # docs/demo_model.md: energy MAE (meV/atom), force MAE (meV/Å) vs CHGNet r2SCAN
    "cantor": (4.0, 99.1),
    "co-pt111": (11.6, 39.1),
    "contacts": (23.7, 282.5),
    "other": (6.5, 135.7),
    "water": (2.3, 68.3),
}

DOCUMENTED_DIRECT = {  # docs/demo_model.md: RMS of direct minus conservative forces (meV/Å), stress (meV/Å³)
    "cantor": (82.2, 7.17),
    "co-pt111": (249.1, None),
    "contacts": (434.3, 26.9),
    "other": (525.8, 26.1),
    "water": (139.9, 4.80),
}


@pytest.fixture(scope="module")
def demo_calc():
    return TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu")


def test_loads_by_name_without_network(demo_calc):
    assert "pet-demo-chgnet" in known_models()
    assert bundled_checkpoint("pet-demo-chgnet").stat().st_size < 10e6
    assert demo_calc.model_name == "pet-demo-chgnet"
    assert {1, 6, 8, 24, 25, 26, 27, 28, 78} <= demo_calc.atomic_types


def test_accuracy_on_the_shipped_test_set(demo_calc):
    table = against_labels(demo_calc, read(TEST_SET, ":"))
    assert set(table) == set(DOCUMENTED)
    for family, (energy_mae, force_mae) in DOCUMENTED.items():
        assert table[family]["energy_mae_meV_atom"] == pytest.approx(energy_mae, rel=0.02, abs=0.1), family
        assert table[family]["force_mae_meV_A"] == pytest.approx(force_mae, rel=0.02, abs=0.5), family


def test_direct_heads_are_as_close_to_the_conservative_forces_as_documented(demo_calc):
    table = direct_against_conservative(demo_calc, read(TEST_SET, ":"))
    assert set(table) == set(DOCUMENTED_DIRECT)
    for family, (force, stress) in DOCUMENTED_DIRECT.items():
        assert table[family]["force_rms_difference"] == pytest.approx(force, rel=0.02, abs=0.5), family
        if stress is not None:
            assert table[family]["stress_rms_difference"] == pytest.approx(stress, rel=0.02, abs=0.05), family


def _direct_outputs(device: str, **options) -> list[np.ndarray]:
    """Energy, direct forces and direct stress of water and a 3D-periodic Cantor-alloy cell,
    one flat vector per structure, from one batched evaluation of the bundled model."""
    cell = next(a for a in read(TEST_SET, ":") if a.info["family"] == "cantor" and a.pbc.all())
    calc = TCPETCalculator(
        "pet-demo-chgnet", device=device, non_conservative=True, progress=False, uncertainty_threshold=None, **options
    )
    results = calc.evaluate([water_box(8, seed=3), cell])
    return [np.concatenate([[r["energy"]], r["forces"].ravel(), r["stress"].ravel()]) for r in results]


def _as_accurate_as_fp32(ours, fp32, exact) -> None:
    """``ours`` as far from ``exact`` (float64) as ``fp32`` is (4x margin: a handful of roundings)."""
    for mine, single, reference in zip(ours, fp32, exact):
        bound = np.abs(single - reference).max()
        assert 0 < bound < 1e-4 * np.abs(reference).max()
        assert np.abs(mine - reference).max() <= 4 * bound


def test_direct_outputs_on_emulated_tensor_cores_are_fp32_accurate():
    """The bundled model's energy and direct heads in fp16x3 on the A100's tensor-core model (CPU)."""
    exact, fp32 = _direct_outputs("cpu", dtype="float64"), _direct_outputs("cpu", precision="fp32")
    _as_accurate_as_fp32(_direct_outputs("cpu", precision="fp16x3", emulate="A100"), fp32, exact)


@pytest.mark.gpu
def test_direct_outputs_on_tensor_cores_are_fp32_accurate():
    """The same with the default calculator on the GPU (its FP32-accurate precision, packed rows, CUDA graphs)."""
    exact, fp32 = _direct_outputs("cuda", dtype="float64"), _direct_outputs("cuda", precision="fp32")
    _as_accurate_as_fp32(_direct_outputs("cuda"), fp32, exact)


def test_short_nve_of_water_conserves_energy(demo_calc):
    atoms = water_box(8, seed=1)
    atoms.calc = demo_calc
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    energies = []
    dyn = VelocityVerlet(atoms, 0.5 * fs)
    dyn.attach(lambda: energies.append(atoms.get_total_energy() / len(atoms)), interval=10)
    dyn.run(200)
    assert np.all(np.isfinite(energies)) and np.ptp(energies) < 5e-3


def test_fire_relaxes_a_cantor_slab_without_collapsing_pairs(demo_calc):
    """The first models pulled Cr-Cr pairs to ~1.05 Å here; the teacher's own minimum of this
    slab has its closest pair (Cr-Cr) at 1.92 Å, the shipped model's at 1.89 Å (477 FIRE steps)."""
    from ase.optimize import FIRE

    from ase_tcfp32.validation import cantor_slab

    atoms = cantor_slab(size=(4, 4, 6), seed=100)
    atoms.rattle(0.05, seed=100)
    atoms.calc = demo_calc
    assert FIRE(atoms, logfile=None).run(fmax=1e-3, steps=600)
    distances = atoms.get_all_distances(mic=True)
    np.fill_diagonal(distances, np.inf)
    assert distances.min() > 1.7


# The LLPR uncertainty (docs/demo_model.md, "Uncertainty"), read the way upet reads it:
# the checkpoint exported by metatrain, run by metatomic-ase's calculator.

STAGE5_PET = "c5f83100c81f55bfb6797410350edcc964fb70ea018c3f16daf7033c26293317"
"""sha256 over the names and bytes of the stage-5 PET's 154 state-dict tensors (sorted by name),
the model before the LLPR (stage 5 of scripts/train_demo_model.sh, with its direct heads): the PET
inside the shipped LLPR model is still exactly that one."""


def _checkpoint():
    import metatomic.torch  # noqa: F401  (registers the TorchScript classes the checkpoint holds)
    import torch

    return torch.load(bundled_checkpoint("pet-demo-chgnet"), weights_only=False, map_location="cpu")


@pytest.fixture(scope="module")
def llpr_calc():
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(bundled_checkpoint("pet-demo-chgnet")).export()
    # per-atom energy uncertainties are ~0.3 eV in-distribution (see the card): metatomic's
    # default 0.1 eV warning threshold would fire on every structure
    return MetatomicCalculator(model, device="cpu", uncertainty_threshold=None)


def _sigma(calc, atoms, sample_kind="system"):
    from metatomic.torch import ModelOutput

    outputs = {"energy_uncertainty": ModelOutput(sample_kind=sample_kind)}
    if sample_kind == "system":
        outputs["energy_ensemble"] = ModelOutput(sample_kind="system")
    result = calc.run_model(atoms, outputs)
    return {name: block.block().values.detach().numpy() for name, block in result.items()}


def test_checkpoint_is_an_llpr_model_around_the_unchanged_pet():
    checkpoint = _checkpoint()
    assert checkpoint["architecture_name"] == "llpr"
    assert checkpoint["model_data"]["hypers"]["num_ensemble_members"] == {"energy": 128}
    assert {
        "covariance_energy_uncertainty",
        "cholesky_energy_uncertainty",
        "multiplier_energy_uncertainty",
        "llpr_ensemble_layers.energy.weight",
    } <= set(checkpoint["model_state_dict"])
    assert checkpoint["model_state_dict"]["llpr_ensemble_layers.energy.weight"].shape == (128, 128)
    multiplier = float(checkpoint["model_state_dict"]["multiplier_energy_uncertainty"])
    assert np.isfinite(multiplier) and multiplier > 0
    wrapped = checkpoint["wrapped_model_checkpoint"]
    assert wrapped["architecture_name"] == "pet"
    state = {name: value for name, value in wrapped["model_state_dict"].items() if hasattr(value, "numpy")}
    assert len(state) == 154
    assert set(wrapped["model_data"]["dataset_info"].targets) == {
        "energy",
        "non_conservative_force",
        "non_conservative_stress",
    }
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().numpy().tobytes())
    assert digest.hexdigest() == STAGE5_PET


def test_package_loader_still_gets_the_bare_pet():
    from metatrain.pet import PET

    from ase_tcfp32 import load_pet

    pet = load_pet("pet-demo-chgnet")
    assert isinstance(pet, PET)
    assert set(pet.output_shapes) == {"energy", "non_conservative_force", "non_conservative_stress"}


def test_llpr_outputs_through_metatomic(llpr_calc):
    outputs = llpr_calc._model.capabilities().outputs
    assert {"energy", "energy_uncertainty", "energy_ensemble"} <= set(outputs)
    assert {"non_conservative_force", "non_conservative_stress"} <= set(outputs)  # the direct heads


def test_uncertainties_are_finite_and_positive_on_held_out_structures(llpr_calc, demo_calc):
    frames = read(TEST_SET, ":")
    for atoms in [next(a for a in frames if a.info["family"] == f) for f in DOCUMENTED]:
        system = _sigma(llpr_calc, atoms)
        sigma, ensemble = float(system["energy_uncertainty"].item()), system["energy_ensemble"].ravel()
        per_atom = _sigma(llpr_calc, atoms, "atom")["energy_uncertainty"].ravel()
        assert np.isfinite(sigma) and 0 < sigma / len(atoms) < 0.05, atoms.info["family"]  # card: 3-46 meV/atom
        assert per_atom.shape == (len(atoms),) and np.all(np.isfinite(per_atom)) and np.all(per_atom > 0)
        assert ensemble.shape == (128,) and np.all(np.isfinite(ensemble))
        # the ensemble is centered on the prediction, with a spread like the uncertainty
        atoms.calc = demo_calc
        assert ensemble.mean() == pytest.approx(atoms.get_potential_energy(), abs=1e-3 * len(atoms))
        assert 0.7 < ensemble.std() / sigma < 1.4, atoms.info["family"]


def _random_gas(seed: int, n: int = 24, box: float = 10.0):
    from ase import Atoms

    rng = np.random.default_rng(seed)
    positions = []
    while len(positions) < n:
        p = rng.uniform(0, box, size=3)
        if all(np.linalg.norm(p - q) > 0.9 for q in positions):
            positions.append(p)
    return Atoms(rng.choice(["H", "C", "O"], size=n).tolist(), positions=positions, cell=[box] * 3, pbc=False)


def test_uncertainty_is_larger_out_of_distribution(llpr_calc):
    """The card: largest held-out uncertainty 46 meV/atom (a contacts structure); a random
    H/C/O gas 196-318 meV/atom, Cantor and Pt cells compressed to 80% 61-292 meV/atom."""
    from ase.build import bulk

    frames = read(TEST_SET, ":")
    held_out = [frames[i] for i in range(0, len(frames), 4)]  # 16 structures, every family
    largest = max(float(_sigma(llpr_calc, a)["energy_uncertainty"].item()) / len(a) for a in held_out)
    compressed = bulk("Pt", "fcc", a=3.92 * 0.8, cubic=True) * (2, 2, 2)
    for atoms in (_random_gas(0), _random_gas(1), compressed):
        sigma = float(_sigma(llpr_calc, atoms)["energy_uncertainty"].item()) / len(atoms)
        assert sigma > 2 * largest, atoms.get_chemical_formula()


def test_upet_calculator_reads_the_uncertainty_and_the_direct_heads():
    """upet's calculator (upet 0.3.1) loads the checkpoint by path: uncertainty and ensemble
    work, and with ``non_conservative=True`` its direct forces are ours to FP32 rounding."""
    upet_calculator = pytest.importorskip("upet.calculator")

    path = bundled_checkpoint("pet-demo-chgnet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = upet_calculator.UPETCalculator(checkpoint_path=path, device="cpu", uncertainty_threshold=None)
        atoms = water_box(8, seed=1)
        atoms.calc = calc
        sigma = float(calc.get_energy_uncertainty(atoms))
        ensemble = calc.get_energy_ensemble(atoms)
        assert 0 < sigma / len(atoms) < 0.05 and ensemble.shape == (128,)
        assert ensemble.mean() == pytest.approx(atoms.get_potential_energy(), abs=1e-3 * len(atoms))
        direct = upet_calculator.UPETCalculator(
            checkpoint_path=path, device="cpu", non_conservative=True, uncertainty_threshold=None
        )
        theirs = direct.get_forces(atoms)
    ours = TCPETCalculator(
        "pet-demo-chgnet", precision="fp32", device="cpu", non_conservative=True, uncertainty_threshold=None
    ).get_forces(atoms)
    assert np.abs(ours - theirs).max() < 1e-4 * np.abs(theirs).max()
