"""The lean engine (plain tensors, Verlet list, static shapes) against the metatomic one;
on the GPU (``gpu``-marked) also the graphs engine (CUDA graphs) and the GPU pair list."""

import numpy as np
import pytest
import torch
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs
from helpers import beads_of

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._lean import MARGIN, LeanPET
from ase_tcfp32._neighbors import pair_vectors
from ase_tcfp32.models import load_pet


def _agree(atoms, model, *, skin=2.0, precision="fp32", stress=True):
    """Evaluate ``atoms`` with both engines; assert FP32-level agreement; return the lean calc."""
    ref, ours = atoms.copy(), atoms.copy()
    ref.calc = TCPETCalculator(model, precision=precision, device="cpu", neighbor_skin=skin, engine="metatomic")
    ours.calc = TCPETCalculator(model, precision=precision, device="cpu", neighbor_skin=skin, engine="lean")
    e_ref = ref.get_potential_energy()
    # metatrain sums large per-atom offsets in FP32 (~1e-6 relative); ours in float64
    assert ours.get_potential_energy() == pytest.approx(e_ref, rel=3e-6, abs=1e-5)
    assert ours.get_potential_energies().sum() == pytest.approx(ours.get_potential_energy(), rel=1e-12)
    forces = ref.get_forces()
    largest = np.abs(forces).max()
    assert largest > 1e-5  # non-trivial (metatrain's test checkpoints give small forces)
    assert np.abs(ours.get_forces() - forces).max() <= 2e-6 * max(1.0, largest)  # FP32 reordering
    if stress and atoms.pbc.all():
        assert np.abs(ours.get_stress() - ref.get_stress()).max() <= 1e-6
    return ours.calc


@pytest.mark.parametrize("name", ["pet-v16", "pet-v8", "llpr-v4"])
def test_lean_matches_metatomic_on_shipped_checkpoints(shipped, ethanol, name):
    _agree(ethanol, shipped(name))


def test_lean_matches_metatomic_with_stress_and_self_images(tiny_ckpt, water, pt_bulk):
    _agree(water, tiny_ckpt)
    calc = _agree(pt_bulk, tiny_ckpt)  # a 3.9 Å cell: atoms see their own periodic images
    pairs = calc._engine.pairs
    i, j = pairs.centers[: pairs.count], pairs.neighbors[: pairs.count]
    assert bool((i == j).any())
    reverse = pairs.reverse[: pairs.count]
    assert torch.equal(i[reverse], j) and torch.equal(pairs.shifts[reverse], -pairs.shifts[: pairs.count])
    cell = torch.tensor(pt_bulk.cell.array, dtype=pairs.offsets.dtype)
    assert torch.allclose(pairs.offsets, pairs.shifts.to(cell.dtype) @ cell, rtol=2**-22, atol=0)


def test_lean_matches_metatomic_on_the_demo_model(water):
    _agree(water, "pet-demo-chgnet")


def test_lean_tf32x3_reference_kernels_match_fp32(tiny_ckpt, water):
    water.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    ref = water.get_forces()
    emulated = water.copy()
    emulated.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cpu", engine="lean")
    assert np.abs(emulated.get_forces() - ref).max() <= 1e-4 * np.abs(ref).max()


def test_verlet_list_is_rebuilt_only_past_half_the_skin(tiny_ckpt, water):
    """MD with a 0.3 Å skin: every step agrees with a fresh metatomic evaluation, and the
    pair list is rebuilt a few times, not every step."""
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean", neighbor_skin=0.3)
    ref = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="metatomic")
    water.calc = calc
    MaxwellBoltzmannDistribution(water, temperature_K=2000, rng=np.random.default_rng(4))
    dyn = VelocityVerlet(water, timestep=1.0 * fs)
    for _ in range(6):
        dyn.run(5)
        copy = water.copy()
        copy.calc = ref
        assert np.abs(water.get_forces() - copy.get_forces()).max() <= 1e-5 * max(1.0, np.abs(copy.get_forces()).max())
    assert 2 <= calc._engine.rebuilds < 31


def test_neighbor_table_widens_when_atoms_crowd_in(tiny_ckpt, water):
    water.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    water.get_forces()
    lean = water.calc._engine
    positions = torch.tensor(water.positions, dtype=torch.float32)
    most = int(lean.neighbor_table(pair_vectors(positions, lean.pairs), torch.tensor(water.numbers), lean.columns)[1])
    assert lean.width == most + MARGIN and lean.widenings == 0
    lean._set_width(8)  # as if the table had been sized for a sparser configuration
    water.calc.reset()
    water.get_forces()
    assert lean.width == most + MARGIN and lean.widenings == 1
    _agree(water, tiny_ckpt)


def test_lean_rejects_models_it_cannot_evaluate_exactly(tiny_ckpt):
    pet = load_pet(tiny_ckpt)
    pet.long_range = True
    with pytest.raises(ValueError, match="long-range"):
        LeanPET(pet, torch.device("cpu"))


def test_engine_names_and_graphs_without_gpu_are_errors(tiny_ckpt):
    with pytest.raises(ValueError, match="unknown engine 'fast'.*metatomic, lean, graphs"):
        TCPETCalculator(tiny_ckpt, device="cpu", engine="fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TCPETCalculator(tiny_ckpt, device="cpu", engine="graphs")


def test_repr_names_the_engine(tiny_ckpt):
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    assert "engine='lean'" in repr(calc)


def test_compiled_lean_engine_matches_eager(tiny_ckpt, water):
    """compile=True also compiles the neighbor table and adaptive cutoffs (on CPU here)."""
    eager = _agree(water, tiny_ckpt)
    compiled = water.copy()
    compiled.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean", compile=True)
    assert np.abs(compiled.get_forces() - eager.results["forces"]).max() <= 3e-5  # fused ops: FP32 reordering
    compiled.positions[0] += 0.05  # moved atoms, and a table widened: no recompilation
    compiled.calc._engine._set_width(8)
    moved = compiled.copy()
    moved.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert np.abs(compiled.get_forces() - moved.get_forces()).max() <= 3e-5
    assert compiled.calc._engine.widenings == 1


def test_lean_matches_metatomic_in_float64(water):
    """A float64 PET: the engines agree to ~1e-10, so nothing but FP32 rounding separates
    them (the skin's extra pairs, the padding and the table layout change nothing)."""
    from ase_tcfp32.testing import random_pet

    pet = random_pet("tiny", seed=11, atomic_types=[1, 8, 78]).to(torch.float64)
    ref, ours = water.copy(), water.copy()
    ref.calc = TCPETCalculator(pet, precision="fp32", device="cpu", engine="metatomic")
    ours.calc = TCPETCalculator(pet, precision="fp32", device="cpu", engine="lean")
    assert ours.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-9)
    assert np.abs(ours.get_forces() - ref.get_forces()).max() < 1e-10
    assert np.abs(ours.get_stress() - ref.get_stress()).max() < 1e-11


def test_lean_handles_atoms_without_neighbors():
    """An isolated atom (no pairs at all) and a dimer: the padding-only tables work."""
    from ase import Atoms

    for atoms in (Atoms("O", positions=[[0, 0, 0]]), Atoms("OH", positions=[[0, 0, 0], [0, 0, 0.97]])):
        ref, ours = atoms.copy(), atoms.copy()
        ref.calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu", engine="metatomic")
        ours.calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device="cpu", engine="lean")
        assert ours.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-5)
        assert np.abs(ours.get_forces() - ref.get_forces()).max() < 1e-5


def test_one_engine_follows_changing_systems(tiny_ckpt, water, pt_bulk, ethanol):
    """One calculator on water, ethanol, Pt, then water with Pt atoms: each result is a
    fresh calculator's, bit for bit (the atomic numbers and the weights are kept on the
    device per system)."""
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
    platinated = water.copy()
    platinated.numbers[:3] = 78
    for atoms in (water, ethanol, pt_bulk, platinated, water):
        ours, fresh = atoms.copy(), atoms.copy()
        ours.calc = calc
        fresh.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine="lean")
        assert ours.get_potential_energy() == fresh.get_potential_energy()  # the same arithmetic: the same bits
        np.testing.assert_array_equal(ours.get_forces(), fresh.get_forces())


def test_results_come_to_the_host_with_their_shapes_and_values():
    from ase_tcfp32._results import Flat

    tensors = {
        "energy": torch.tensor([1.5, -2.25], dtype=torch.float64),
        "forces": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 3,
        "sizes": torch.tensor([7, 2**40 + 1]),
        "virial": torch.zeros(2, 3, 3),
    }
    more = {**tensors, "flag": torch.tensor(True)}
    first, rest = dict(list(more.items())[:2]), dict(list(more.items())[2:])
    for flat, wanted in ((Flat.of(tensors), tensors), (Flat.of(first).plus(rest), more)):  # plus: one copy still
        host = flat.to_host()
        assert list(host) == list(wanted)
        for name, tensor in wanted.items():
            assert host[name].dtype == np.float64 and host[name].shape == tuple(tensor.shape)
            np.testing.assert_array_equal(host[name], tensor.double().numpy())
        assert int(host["sizes"][1]) == 2**40 + 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_arrays_go_to_the_device_as_copies_rounded_as_torch_rounds(device):
    """Rounded on the device, as torch's ``.to(device, dtype)`` rounds them on the host."""
    from ase_tcfp32._neighbors import uploaded

    rng = np.random.default_rng(0)
    positions = rng.normal(0, 10, (1000, 3)) * np.exp(rng.normal(0, 20, (1000, 1)))  # exponents far apart
    for dtype in (torch.float32, torch.float64):
        tensor = uploaded(positions, torch.device(device), dtype)
        assert tensor.dtype == dtype and tensor.device.type == device
        assert torch.equal(tensor.cpu(), torch.from_numpy(positions).to(dtype))
        if device == "cpu":
            assert not np.shares_memory(tensor.numpy(), positions)
    assert uploaded(positions[:, ::2], torch.device(device), torch.float32).shape == (1000, 2)  # a strided view


@pytest.mark.parametrize("engine", ["lean", "metatomic"])
def test_a_batch_gives_what_single_calls_give(tiny_ckpt, water, engine):
    """32 beads in one call: per structure the energies, forces and stresses of 32 single
    calls, to FP32 rounding (the batch sums in another order)."""
    beads = beads_of(water, 32)
    calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine=engine)
    batched = calc.evaluate(beads)
    assert len(batched) == 32
    alone = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu", engine=engine)
    for atoms, result in zip(beads, batched):
        single = atoms.copy()
        single.calc = alone
        assert result["energy"] == pytest.approx(single.get_potential_energy(), rel=3e-6, abs=1e-5)
        assert result["free_energy"] == result["energy"]
        assert np.abs(result["forces"] - single.get_forces()).max() <= 2e-6 * max(1.0, np.abs(result["forces"]).max())
        assert np.abs(result["stress"] - single.get_stress()).max() <= 1e-6
        assert result["energies"].sum() == pytest.approx(result["energy"], rel=1e-6)


def test_a_batch_of_different_structures(tiny_ckpt, water, pt_bulk, ethanol):
    """Different sizes, cells and periodicities in one batch, twice (the pair list and the
    table are kept), in the emulated precision too: each as evaluated alone."""
    structures = [water, ethanol, pt_bulk, water.repeat((2, 1, 1))]
    for precision in ("fp32", "tf32x3"):
        calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cpu", engine="lean")
        for _ in range(2):
            batched = calc.evaluate(structures)
            for atoms, result in zip(structures, batched):
                alone = calc.evaluate([atoms])[0]
                assert result["energy"] == pytest.approx(alone["energy"], rel=3e-6, abs=1e-5)
                assert np.abs(result["forces"] - alone["forces"]).max() <= 1e-5
                assert ("stress" in result) == bool(atoms.pbc.all())
                if "stress" in result:  # each structure's virial from its own pairs only
                    assert np.abs(result["stress"] - alone["stress"]).max() <= 1e-6
            for atoms in structures:
                atoms.positions += 0.02
    assert calc.evaluate([]) == []
    with pytest.raises(ValueError, match="NaN"):
        broken = water.copy()
        broken.positions[0, 0] = np.nan
        calc.evaluate([water, broken])


def test_pair_terms_backward_sums_each_atoms_pairs_and_their_reverses(water, pt_bulk, ethanol):
    """The gradients of the pair vectors ``x[j] - x[i]`` and of the pair cutoffs' sums
    ``r[i] + r[j]`` (a gather by reverse pair and a segment sum per center) are the
    scatter-adds of every pair's gradient onto its two atoms, in float64 to rounding: a
    batch with periodic self-images, a molecule and an isolated atom (an empty segment),
    padding included."""
    from ase import Atoms

    from ase_tcfp32._neighbors import PairTerms, Structures, build_pairs

    lone = Atoms("O", positions=[[0.0, 0.0, 0.0]])
    batch = Structures.of([water, pt_bulk, lone, ethanol])
    positions = torch.tensor(batch.positions, requires_grad=True)
    pairs = build_pairs(positions.detach(), batch.cells, batch.pbcs, batch.sizes, 5.0, 0)
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(pairs.valid.numel(), 3, dtype=torch.float64, generator=g) * pairs.valid[:, None]
    (ours,) = torch.autograd.grad((pair_vectors(positions, pairs) * weights).sum(), positions)
    plain = positions.index_select(0, pairs.neighbors) - positions.index_select(0, pairs.centers) + pairs.offsets
    (expected,) = torch.autograd.grad((plain * weights).sum(), positions)
    assert pairs.count < pairs.valid.numel() and torch.equal(
        ours[len(water) + len(pt_bulk)], torch.zeros(3, dtype=torch.float64)
    )
    assert torch.allclose(ours, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))
    assert not torch.equal(ours, torch.zeros_like(ours))

    cutoffs = torch.rand(len(positions), dtype=torch.float64, generator=g).requires_grad_()
    sums = PairTerms.apply(cutoffs, pairs.centers, pairs.neighbors, pairs.reverse, pairs.first, 1.0)
    (ours,) = torch.autograd.grad((sums * weights[:, 0]).sum(), cutoffs)
    plain = cutoffs.index_select(0, pairs.centers) + cutoffs.index_select(0, pairs.neighbors)
    assert torch.equal(sums, plain)
    (expected,) = torch.autograd.grad((plain * weights[:, 0]).sum(), cutoffs)
    assert torch.allclose(ours, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_all_pairs_of_small_cells_are_vesins(water, pt_bulk):
    """The GPU's lists for small periodic cells (every atom pair and image at once, several
    structures in one go) hold exactly vesin's pairs and shifts: atoms outside the cell, a
    triclinic cell, and a 3.9 Å cell whose atoms see their own images up to 3 cells away;
    each with a rattled copy of itself in the same call."""
    from vesin import NeighborList

    from ase_tcfp32._neighbors import all_pairs, images_needed

    unwrapped = water.copy()
    unwrapped.positions += [7.3, -13.0, 30.0]
    unwrapped.rattle(0.3, seed=1)
    triclinic = water.copy()
    triclinic.set_cell(water.cell.array + [[0, 0, 0], [2.5, 0, 0], [1.0, 1.5, 0]], scale_atoms=False)
    for atoms, cutoff, reach in [(unwrapped, 10.0, [2, 2, 2]), (triclinic, 8.5, [2, 2, 2]), (pt_bulk, 10.0, [3, 3, 3])]:
        rattled = atoms.copy()
        rattled.rattle(0.2, seed=2)
        positions, cells = (
            torch.tensor(np.stack([atoms.positions, rattled.positions])),
            np.stack([atoms.cell.array] * 2),
        )
        assert images_needed(cells[0], cutoff) == reach
        b, i, j, s = all_pairs(positions, cells, cutoff, reach)
        for k in range(2):
            ours = (i[b == k], j[b == k], s[b == k])
            theirs = NeighborList(cutoff=cutoff, full_list=True).compute(
                points=positions[k], box=cells[k], periodic=True, quantities="ijS", copy=True
            )
            listed = [sorted(zip(i.tolist(), j.tolist(), map(tuple, s.tolist()))) for i, j, s in (ours, theirs)]
            assert listed[0] == listed[1] and len(listed[0]) > len(atoms)


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32x3", "fp16x3"])
def test_lean_and_graph_engines_match_metatomic_on_gpu(tiny_ckpt, water192, precision):
    if precision == "fp16x3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fp16x3 runs on Hopper")
    results = {}
    for engine in ("metatomic", "lean", "graphs"):
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision=precision, device="cuda", engine=engine)
        results[engine] = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        if engine != "metatomic":  # PET on packed rows where the attention is ours
            assert atoms.calc._engine.packed == (precision != "fp32")
    e0, f0, s0 = results["metatomic"]
    for engine in ("lean", "graphs"):
        e, f, s = results[engine]
        assert abs(e - e0) / len(water192) < 2e-6
        assert np.abs(f - f0).max() < 3e-5
        assert np.abs(s - s0).max() < 1e-6


@pytest.mark.gpu
def test_graph_replays_follow_md_across_list_rebuilds_and_wider_tables(tiny_ckpt, water192):
    """A hot MD run with a 0.4 Å skin: the pair list is rebuilt in place under the
    recorded graph, and a table too narrow for crowded atoms is widened (re-recorded);
    every step's forces agree with a fresh metatomic evaluation."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs", neighbor_skin=0.4)
    reference = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="metatomic")
    MaxwellBoltzmannDistribution(atoms, temperature_K=3000, rng=np.random.default_rng(2))
    dyn = VelocityVerlet(atoms, 1.0 * fs)
    lean = atoms.calc._engine
    for block in range(5):
        dyn.run(4)
        if block == 2:
            lean._set_width(8)  # as if the table had been sized for a sparser configuration
            atoms.calc.reset()
        if block == 3:
            lean._set_rows(1000)  # and the packed rows for far fewer pairs
            atoms.calc.reset()
        copy = atoms.copy()
        copy.calc = reference
        assert np.abs(atoms.get_forces() - copy.get_forces()).max() < 3e-5
    assert lean.rebuilds >= 2 and lean.width > 8 and lean.widenings >= 1 and lean.packed and lean.rows > 1000


@pytest.mark.gpu
def test_no_garbage_collection_runs_while_a_graph_is_captured(tiny_ckpt, water192):
    """The collector may free an old calculator's graph, a CUDA call a capture forbids: with
    the collector set to run every 100 allocations, none of its runs falls inside the
    capture of a new calculator's step, which records and gives forces."""
    import gc

    old = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs")
    old.get_forces(water192.copy())
    old.itself = old  # a cycle: only the collector frees it and its graph
    del old
    during = []

    def collecting(phase, info):
        if phase == "start":
            during.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.callbacks.append(collecting)
    gc.set_threshold(100)  # thousands of objects are made during a capture
    try:
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs")
        atoms.get_forces()  # the watchdog's eager step
        atoms.positions[0, 0] += 0.01
        forces = atoms.get_forces()  # recorded, then replayed
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(collecting)
    assert atoms.calc._engine.recordings == 1 and np.isfinite(forces).all()
    assert during and not any(during)


@pytest.mark.gpu
def test_compiled_graph_engine_matches_metatomic(tiny_ckpt, water192):
    """compile=True with engine='graphs': compiled code recorded in the graph, same forces."""
    atoms = water192.copy()
    atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="graphs", compile=True)
    reference = water192.copy()
    reference.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="metatomic")
    for _ in range(3):  # recorded once, replayed after
        atoms.positions += 0.01
        reference.positions += 0.01
        assert abs(atoms.get_potential_energy() - reference.get_potential_energy()) / len(atoms) < 2e-6
        assert np.abs(atoms.get_forces() - reference.get_forces()).max() < 3e-5


@pytest.mark.gpu
def test_a_batch_of_32_copies_gives_what_32_single_calls_give(water192):
    """32 beads of the 192-atom box in one call (6,144 atoms: our kernels, not cuBLAS), in
    the default precision: per structure the energies, forces and stresses of single calls."""
    from helpers import beads_of

    from ase_tcfp32.testing import random_checkpoint

    beads = beads_of(water192, 32)
    model = random_checkpoint("xs", seed=3)
    batched = TCPETCalculator(model, device="cuda").evaluate(beads)
    alone = TCPETCalculator(model, device="cuda")
    for bead, result in zip(beads, batched):
        single = alone.evaluate([bead])[0]
        assert result["energy"] == pytest.approx(single["energy"], rel=3e-6, abs=1e-4)
        assert np.abs(result["forces"] - single["forces"]).max() < 3e-5
        assert np.abs(result["stress"] - single["stress"]).max() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("batch_of", ["beads", "mixed"])
def test_the_gpus_pair_list_of_a_batch_is_vesins(water192, pt_bulk, batch_of):
    """On the GPU small periodic cells get their pairs from our search kernels (beads of one
    box, :mod:`ase_tcfp32._kernels.pairs`) or lean.all_pairs (a batch with others), on the
    CPU from vesin: the same pairs, reverses, shifts, offsets and structures of pairs for
    beads, a triclinic cell, a cell whose atoms see their own images and a molecule."""
    from ase.build import molecule
    from helpers import beads_of

    from ase_tcfp32._neighbors import VIRIAL_BINS, Structures, build_pairs

    triclinic = water192.copy()
    triclinic.set_cell(water192.cell.array + [[0, 0, 0], [3.0, 0, 0], [1.0, 2.0, 0]], scale_atoms=False)
    structures = beads_of(water192, 8)
    if batch_of == "mixed":
        structures += [triclinic, pt_bulk, molecule("CH3CH2OH")]
    batch = Structures.of(structures)
    lists = []
    for device in ("cpu", "cuda"):
        positions = torch.tensor(batch.positions, dtype=torch.float64, device=device)
        pairs = build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, 10.0, 0)
        structure = pairs.bins // VIRIAL_BINS
        key = torch.cat([pairs.centers[:, None], pairs.neighbors[:, None], pairs.shifts, structure[:, None]], 1)
        key = torch.cat([key, key[pairs.reverse, :2]], 1)[: pairs.count]
        order = torch.from_numpy(np.lexsort(key.cpu().numpy().T[::-1]))
        lists.append([key.cpu()[order], pairs.offsets.cpu()[: pairs.count][order], pairs.first.cpu()])
    assert torch.equal(lists[0][0], lists[1][0]) and torch.equal(lists[0][2], lists[1][2])
    assert torch.allclose(lists[0][1], lists[1][1], rtol=0, atol=1e-12)
