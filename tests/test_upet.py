"""upet's keywords and outputs on TCPETCalculator (CPU): direct forces and stress,
variants, float64, energy-only calls, and clear errors for what we do not understand.

Bounds: two FP32 evaluations of the same model in different orders of operations differ
by a few hundred rounding units (2^-24) of the largest term at most; 1e-5 relative leaves
a margin of ~10x over what is seen (1-4e-7)."""

import copy
import warnings

import numpy as np
import pytest
import torch
from helpers import quiet_calculator as calculator

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.models import import_dependencies, load_pet
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

FP32 = 1e-5
"""Relative agreement of two FP32 evaluations of one model (see the module doc)."""


@pytest.fixture(scope="module")
def pet():
    return random_pet("tiny", seed=3, atomic_types=[1, 6, 8])


@pytest.fixture
def water():
    atoms = water_box(8)
    atoms.rattle(0.05, seed=1)
    return atoms


def close(a, b, rel=FP32):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= rel * max(np.abs(b).max(), 1e-12)


def test_a_keyword_neither_upet_nor_we_have_is_refused(tiny_ckpt):
    with pytest.raises(TypeError, match="unexpected keyword argument 'uncertainty_treshold'"):
        TCPETCalculator(tiny_ckpt, device="cpu", uncertainty_treshold=0.1)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"non_conservative": "yes"}, ValueError, "non_conservative is False, True, 'forces' or 'stress'"),
        ({"variants": {"energy": "pbe"}}, ValueError, "no output 'energy/pbe': its energy outputs are energy"),
        ({"variants": {"dipole": None}}, ValueError, r"variants for unknown outputs \['dipole'\]"),
        ({"variants": "pbe"}, TypeError, "variants is a dict"),
        ({"dtype": "float16"}, ValueError, "dtype is 'float32' or 'float64'"),
        ({"dtype": torch.float64, "precision": "tf32x3"}, ValueError, "cannot be combined with precision='tf32x3'"),
        ({"rotational_average_batch_size": 4}, ValueError, "rotational_average_batch_size needs rotational_average"),
        ({"rotational_average_order": 3, "rotational_average_batch_size": 0}, ValueError, "positive number of copies"),
    ],
)
def test_bad_values_are_refused_before_the_model_loads(options, error, message):
    """Each error comes before any evaluation, most before the model is even prepared."""
    with pytest.raises(error, match=message):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TCPETCalculator(random_pet("tiny", atomic_types=[1, 8]), device="cpu", **options)


def test_a_model_without_direct_heads_says_so(pet):
    plain = copy.deepcopy(pet)
    plain.remove_output("non_conservative_force")
    with pytest.raises(ValueError, match="no direct \\(non-conservative\\) forces head"):
        calculator(plain, non_conservative="forces")
    calculator(plain, non_conservative="stress")  # the stress head is there


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_direct_forces_and_stress_are_metatrains(pet, water, engine):
    """The direct heads' forces (net force removed) and stress, in both engines, equal
    metatrain's own outputs through metatomic-ase's calculator with non_conservative=True."""
    import_dependencies(metatomic_ase=True)
    from metatomic_ase import MetatomicCalculator

    reference = MetatomicCalculator(load_pet(copy.deepcopy(pet)).export(), device="cpu", non_conservative=True)
    atoms = water.copy()
    atoms.calc = reference
    expected = atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
    atoms.calc = calculator(pet, engine=engine, non_conservative=True)
    forces, stress, energy = atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
    assert close(forces, expected[0]) and close(stress, expected[1]) and close(energy, expected[2])
    assert np.abs(forces.sum(0)).max() < FP32 * np.abs(forces).max() * len(atoms)
    conservative = calculator(pet, engine=engine).get_forces(water)
    assert not close(forces, conservative, 0.1)  # random heads: the two kinds of forces differ


def test_direct_forces_bring_the_direct_stress_of_a_periodic_system(pet, water):
    """ASE's ``get_forces`` then ``get_stress`` (NPT, relaxations with a cell filter) is one
    forward pass with the direct heads, as it is one forward and backward pass without."""
    atoms = water.copy()
    atoms.calc = calculator(pet, non_conservative=True)
    atoms.get_forces()
    assert "stress" in atoms.calc.results and not atoms.calc.check_state(atoms)
    molecule = water[:3].copy()
    molecule.pbc = False
    molecule.calc = atoms.calc
    molecule.get_forces()
    assert "stress" not in molecule.calc.results


def test_the_metatomic_engine_reads_energy_and_direct_heads_from_one_model_call(pet, water):
    """With direct forces and stress (and no conservative result asked) the energy comes from
    the direct heads' forward pass: one model call per evaluation, not one for the energy
    and one for the heads; the same energy, energies and direct results as asked apart."""
    calc = calculator(pet, engine="metatomic", non_conservative=True)
    calls = []
    calc.pet.backend.edge_embedder.register_forward_hook(lambda *args: calls.append(1))
    atoms = water.copy()
    atoms.calc = calc
    forces, stress, energy = atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
    assert len(calls) == 1
    plain = calculator(pet, engine="metatomic")
    assert close(energy, plain.get_potential_energy(water))
    apart = plain.evaluate([water], ["non_conservative_forces", "non_conservative_stress"])[0]
    assert close(forces, apart["non_conservative_forces"]) and close(stress, apart["non_conservative_stress"])
    structures = [water, water.copy()]
    structures[1].rattle(0.02, seed=5)
    calls.clear()
    batch = calc.evaluate(structures, ["energy", "energies", "forces"])
    assert len(calls) == 1
    for result, atoms in zip(batch, structures):
        assert close(result["energy"], plain.get_potential_energy(atoms)) and close(
            result["energies"].sum(), result["energy"]
        )


@pytest.mark.parametrize("setting", ["forces", "stress"])
def test_one_direct_quantity_leaves_the_other_conservative(pet, water, setting):
    atoms = water.copy()
    atoms.calc = calculator(pet, non_conservative=setting)
    both = calculator(pet).evaluate([water], ["forces", "stress", "non_conservative_forces", "non_conservative_stress"])
    other = "stress" if setting == "forces" else "forces"
    direct = {"forces": atoms.get_forces(), "stress": atoms.get_stress()}
    assert close(direct[setting], both[0][f"non_conservative_{setting}"])
    assert close(direct[other], both[0][other])


def test_evaluate_gives_both_kinds_of_forces_from_one_call(pet, water):
    """What multiple time stepping asks for: conservative and direct forces together, and
    the direct ones alone (no backward pass: no conservative forces in the result)."""
    calc = calculator(pet)
    structures = [water, water.copy()]
    structures[1].rattle(0.02, seed=5)
    both = calc.evaluate(structures, ["energy", "forces", "non_conservative_forces"])
    alone = calc.evaluate(structures, ["energy", "non_conservative_forces"])
    for pair, single in zip(both, alone):
        assert "forces" in pair and "forces" not in single and "stress" not in single
        assert close(single["non_conservative_forces"], pair["non_conservative_forces"])
        assert single["energy"] == pytest.approx(pair["energy"], rel=FP32)
    with pytest.raises(ValueError, match=r"unknown properties \['force'\]"):
        calc.evaluate(structures, ["force"])


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_an_energy_only_call_computes_no_forces_and_forces_come_after(pet, water, engine):
    calc = calculator(pet, engine=engine)
    atoms = water.copy()
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    assert "forces" not in calc.results and "stress" not in calc.results
    forces = atoms.get_forces()
    assert atoms.calc.results["energy"] == pytest.approx(energy, rel=FP32)
    assert close(forces, calculator(pet, engine=engine).get_forces(water))


def test_float64_runs_the_model_in_fp64(pet, water):
    """dtype=float64 (upet's keyword): FP64 throughout; FP32 agrees with it to FP32's error,
    and the metatomic engine in float64 to float64's."""
    fp64 = calculator(pet, dtype="float64", precision="auto")
    assert fp64.precision == "fp64" and next(fp64.pet.parameters()).dtype == torch.float64
    reference = calculator(pet, dtype=torch.float64, engine="metatomic")
    forces = fp64.get_forces(water)
    assert close(forces, reference.get_forces(water), 1e-10)
    assert close(calculator(pet).get_forces(water), forces)
    assert "fp64" in repr(fp64)


@pytest.fixture(scope="module")
def variant_pet():
    """A small PET with two energy heads, "energy" and "energy/alt"."""
    import_dependencies()
    from metatrain.pet import PET
    from metatrain.utils.architectures import get_default_hypers
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    hypers = get_default_hypers("pet")["model"]
    hypers.update(d_pet=16, d_node=64, d_head=16, d_feedforward=32, num_heads=4, num_gnn_layers=1, cutoff=4.0)
    targets = {
        name: get_energy_target_info(name, {"quantity": "energy", "unit": "eV"}) for name in ("energy", "energy/alt")
    }
    torch.manual_seed(0)
    return PET(hypers, DatasetInfo(length_unit="Angstrom", atomic_types=[1, 8], targets=targets))


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_variants_choose_the_head(variant_pet, water, engine):
    default = calculator(variant_pet, engine=engine).get_potential_energy(water)
    alt = calculator(variant_pet, engine=engine, variants={"energy": "alt"}).get_potential_energy(water)
    assert calculator(variant_pet, engine=engine, variants={"energy": None}).get_potential_energy(water) == default
    assert abs(alt - default) > 0.1
    other = calculator(variant_pet, engine="metatomic" if engine == "lean" else "lean", variants={"energy": "alt"})
    assert close(other.get_potential_energy(water), alt)


def test_the_upet_positional_order_is_kept(tiny_ckpt):
    """UPETCalculator(model, version, dtype, checkpoint_path, variants, order, batch size)."""
    calc = TCPETCalculator("unused-name", "latest", "float32", tiny_ckpt, None, device="cpu", progress=False)
    assert calc.model_name == tiny_ckpt.name


def test_rotational_averaging_through_the_calculator(pet):
    """upet's rotational_average_order: the prediction of a molecule barely moves when the
    input is rotated (here at least 10x less than without averaging; measured ~1e4x), the
    spread over the quadrature is stored, and get_forces is the back-rotated average. Order 2
    (60 copies per call) keeps the test short; tests/test_rotations.py checks order 5."""
    from ase.build import molecule
    from scipy.spatial.transform import Rotation

    plain = calculator(pet)
    averaged = calculator(pet, rotational_average_order=2, rotational_average_batch_size=40)
    spreads = []
    for calc in (plain, averaged):
        energies = []
        for rotation in Rotation.random(3, random_state=7).as_matrix():
            atoms = molecule("CH3OH")
            atoms.positions = atoms.positions @ rotation.T
            atoms.calc = calc
            energies.append(atoms.get_potential_energy())
        spreads.append(np.ptp(energies))
    assert spreads[1] * 10 <= spreads[0] and spreads[0] > 1e-4
    atoms.get_forces()
    assert {"energy_rot_std", "forces_rot_std"} <= set(averaged.results)
    assert averaged.results["forces"].shape == averaged.results["forces_rot_std"].shape == (6, 3)


def test_the_llpr_uncertainty_and_ensemble_are_metatrains():
    """upet's get_energy_uncertainty / get_energy_ensemble on the bundled demo model (an LLPR
    around its PET), in both engines, equal metatrain's own outputs (its LLPR model exported,
    run by metatomic-ase) to FP32 rounding, per structure and per atom; the ensemble's mean
    is the energy; a compressed box is more uncertain per atom than the held-out density."""
    import_dependencies(metatomic_ase=True)
    from metatomic.torch import ModelOutput
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    from ase_tcfp32.models import bundled_checkpoint

    atoms = water_box(8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = MetatomicCalculator(
            load_model(bundled_checkpoint("pet-demo-chgnet")).export(), device="cpu", uncertainty_threshold=None
        )
    expected = {}
    for kind in ("system", "atom"):
        outputs = {name: ModelOutput(sample_kind=kind) for name in ("energy_uncertainty", "energy_ensemble")}
        out = reference.run_model(atoms, outputs)
        expected[kind] = [out[name].block().values.detach().double().numpy() for name in outputs]
    for engine in ("lean", "metatomic"):
        calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu", engine=engine, progress=False)
        assert calc.supports_uncertainty
        sigma, per_atom = calc.get_energy_uncertainty(atoms), calc.get_energy_uncertainty(atoms, per_atom=True)
        ensemble, atom_ensemble = calc.get_energy_ensemble(atoms), calc.get_energy_ensemble(atoms, per_atom=True)
        assert sigma.shape == () and per_atom.shape == (len(atoms),) and np.all(per_atom > 0)
        assert ensemble.shape == (128,) and atom_ensemble.shape == (len(atoms), 128)
        assert close(sigma, expected["system"][0].ravel()[0]) and close(per_atom, expected["atom"][0].ravel())
        assert close(ensemble, expected["system"][1].ravel()) and close(atom_ensemble, expected["atom"][1])
        assert ensemble.mean() == pytest.approx(calc.get_potential_energy(atoms), rel=FP32)
    compressed = atoms.copy()
    compressed.set_cell(atoms.cell * 0.8, scale_atoms=True)
    per_atom_sigma = [float(calc.get_energy_uncertainty(a)) / len(a) for a in (atoms, compressed)]
    assert per_atom_sigma[1] > 2 * per_atom_sigma[0]


def test_a_model_without_llpr_says_so(pet, water):
    calc = calculator(pet)
    assert not calc.supports_uncertainty
    with pytest.raises(NotImplementedError, match="carries no LLPR uncertainty"):
        calc.get_energy_uncertainty(water)


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3", "bf16x9"])
def test_direct_heads_on_tensor_cores_are_fp32_accurate(pet, precision):
    """Every upet output in an FP32-accurate precision (packed rows, CUDA graphs) is as far
    from the float64 model as FP32's own (4x margin: a handful of roundings apart), energy
    and direct forces and stress, batched; an energy-only call, then forces, works; the
    rotational average runs on the GPU."""
    from ase_tcfp32.precision import support

    if support(precision, torch.device("cuda")).backend == "unavailable":
        pytest.skip(f"{precision} does not run on this GPU")
    structures = [water_box(32, seed=k) for k in range(3)]
    wanted = ["energy", "forces", "stress", "non_conservative_forces", "non_conservative_stress"]
    exact = calculator(pet, dtype="float64", device="cuda").evaluate(structures, wanted)
    errors = {}
    for name in ("fp32", precision):
        results = calculator(pet, precision=name, device="cuda").evaluate(structures, wanted)
        errors[name] = {
            key: max(np.abs(np.asarray(r[key]) - np.asarray(e[key])).max() for r, e in zip(results, exact))
            for key in ("energy", "forces", "non_conservative_forces", "non_conservative_stress")
        }
    for key, fp32 in errors["fp32"].items():
        assert errors[precision][key] <= 4 * fp32 + 1e-9, (key, errors)
    calc = calculator(pet, precision=precision, device="cuda", non_conservative=True)
    atoms = structures[0].copy()
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    assert "forces" not in calc.results
    assert close(atoms.get_forces(), exact[0]["non_conservative_forces"], 1e-4)
    assert atoms.get_potential_energy() == pytest.approx(energy, rel=1e-6)
    averaged = calculator(pet, precision=precision, device="cuda", rotational_average_order=2)
    assert np.isfinite(averaged.get_potential_energy(structures[1])) and "energy_rot_std" in averaged.results


@pytest.mark.gpu
def test_the_llpr_uncertainty_on_tensor_cores():
    """The demo model's uncertainty and ensemble with the default calculator on the GPU
    (packed rows, CUDA graphs) agree with the FP32 CPU evaluation to FP32's error of the
    features (the ensemble's spread, sigma ~0.1 eV, is what matters: 1e-4 relative)."""
    atoms = water_box(32, seed=2)
    cpu = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu", progress=False)
    gpu = TCPETCalculator("pet-demo-chgnet", device="cuda", progress=False)
    for per_atom in (False, True):
        assert close(gpu.get_energy_uncertainty(atoms, per_atom), cpu.get_energy_uncertainty(atoms, per_atom), 1e-4)
        ensemble, expected = (c.get_energy_ensemble(atoms, per_atom) for c in (gpu, cpu))
        assert close(ensemble - ensemble.mean(-1, keepdims=True), expected - expected.mean(-1, keepdims=True), 1e-4)
    atoms.calc = gpu
    atoms.get_forces()  # the graph of a forces call, then the features' own
    assert np.isfinite(gpu.get_energy_uncertainty()).all()
