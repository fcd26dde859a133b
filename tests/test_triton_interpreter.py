"""The TF32 Triton kernels' indexing, masking, bias and Inf/NaN logic, run on CPU
through Triton's interpreter (which computes the dots in FP32 numpy, so it checks the
kernel's logic, not tensor-core rounding; BF16 dots are not supported there)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ase_tcfp32._kernels.reference import ReferenceBackend
    from ase_tcfp32._kernels.triton_gemm import TritonBackend

    g = torch.Generator().manual_seed(0)
    for precision in ("tf32", "tf32x3"):
        triton_, ref = TritonBackend(precision), ReferenceBackend(precision)
        for m, k, n in [(0, 20, 8), (1, 64, 5), (37, 40, 20), (130, 17, 33), (129, 70, 130), (200, 4, 16)]:
            x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            if m > 2:
                x[1, 3], x[2, 0] = float("inf"), float("nan")
            if m == 129:  # a non-finite weight takes the kernel's output-masking branch
                w[5, 2] = -float("inf")
            y = triton_.forward(x, triton_.prepare(w), b)
            expected = x @ w.T + b
            assert y.shape == (m, n)
            assert torch.equal(torch.isnan(y), torch.isnan(expected)), (precision, m, k, n)
            assert torch.equal(torch.isinf(y), torch.isinf(expected)), (precision, m, k, n)
            finite = torch.isfinite(expected)
            tol = 2e-2 if precision == "tf32" else 1e-5
            assert torch.allclose(y[finite], expected[finite], rtol=tol, atol=tol), (precision, m, k, n)
            grad = torch.randn(m, n, generator=g)
            dx = triton_.grad_input(grad, triton_.prepare(w))
            assert torch.allclose(dx, grad @ w, rtol=tol, atol=tol), (precision, m, k, n)
    # products with few rows (the GPU's small path): 64-row tiles give the bits of the tuned
    # ones; parts of the K-tiles (the bias added once) give the product; an empty part is refused
    from ase_tcfp32._kernels.triton_gemm import launch
    triton_ = TritonBackend("tf32x3")
    x, w, b = torch.randn(70, 200, generator=g), torch.randn(40, 200, generator=g), torch.randn(40, generator=g)
    gemm = triton_.prepare(w).forward
    assert torch.equal(launch(x, gemm, b, rows=64), launch(x, gemm, b))
    r = torch.randn(70, 40, generator=g)
    for epilogue in ({"residual": r}, {"activation": "silu", "keep": True}, {"activation": "swiglu", "keep": True},
                     {"rms_eps": 1e-5}):
        small, tuned = launch(x, gemm, b, rows=64, **epilogue), launch(x, gemm, b, **epilogue)
        for one, other in zip(*((t,) if isinstance(t, torch.Tensor) else t for t in (small, tuned))):
            assert torch.equal(one, other), epilogue
    for splits in (2, 4):
        y = launch(x, gemm, b, rows=64, splits=splits)
        assert y.shape == (70, 40) and torch.allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5), splits
    try:
        launch(x, gemm, b, rows=64, splits=6)  # 7 K-tiles of 32: parts of 2, the sixth empty
        raise AssertionError("6 parts of 7 K-tiles accepted")
    except ValueError as error:
        assert "empty" in str(error)
    try:
        launch(x, gemm, b, activation="silu", splits=2)
        raise AssertionError("an activation in parts accepted")
    except ValueError as error:
        assert "bias only" in str(error)
    print("interpreter kernels ok")
    """
)


def interpret(script: str, done: str) -> None:
    """Run ``script`` in a fresh process under Triton's interpreter; it must print ``done``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert done in result.stdout


def test_tf32_kernels_in_the_triton_interpreter():
    interpret(SCRIPT, "interpreter kernels ok")


SAME_PET_AFTER = textwrap.dedent(
    """
    import numpy as np
    import torch
    from ase_tcfp32._engines import PROPERTIES
    from ase_tcfp32._lean import LeanPET
    from ase_tcfp32.models import load_pet
    from ase_tcfp32.validation import water_box


    # The energy, forces and stress of ``ours`` no further from the float64 ``exact`` than
    # ``plain``'s (FP32 computed another way), up to a few roundings of the largest value.
    def no_further(ours, plain, exact, atoms):
        u = 2.0**-24
        for key in ("energy", "forces", "stress"):
            error, unfused = (np.abs(np.asarray(r[key]) - exact[key]).max() for r in (ours, plain))
            terms = len(atoms) if key == "energy" else 1
            assert error <= 2 * unfused + 16 * terms * u * np.abs(exact[key]).max(), (key, error, unfused)


    # The bundled demo model on a rattled 24-atom water box (lean engine, CPU) before and after
    # swap(pet) (which must return True): energy, forces and stress no further from the float64
    # model's than before. Returns the model, the engine, the atoms and the results after.
    def same_pet_after(swap):
        pet = load_pet("pet-demo-chgnet", "latest")
        atoms = water_box(8)
        atoms.rattle(0.05, seed=1)
        exact = LeanPET(load_pet("pet-demo-chgnet", "latest").double(), torch.device("cpu"), 2.0, 0, None)
        exact = exact.compute([atoms], PROPERTIES)[0]
        lean = LeanPET(pet, torch.device("cpu"), 2.0, 0, None)
        lean._solver_kernel = None  # metatrain's solver: the cutoff kernel has its own test (and is slow interpreted)
        before = lean.compute([atoms], PROPERTIES)[0]
        assert swap(pet)
        after = lean.compute([atoms], PROPERTIES)[0]
        no_further(after, before, exact, atoms)
        return pet, lean, atoms, after
    """
)


ATTENTION_SCRIPT = SAME_PET_AFTER + textwrap.dedent(
    """
    from ase_tcfp32._attention import swap_attention_blocks, tc_attention
    from ase_tcfp32._swapping import recompute_gnn_layers

    g = torch.Generator().manual_seed(0)
    u = 2.0**-24
    # sequences packed 3, 2 and 1 per block, a block with one sequence of 100 tokens, heads of 16 to 48
    for atoms, tokens, heads, dim in [(7, 41, 8, 32), (5, 13, 2, 48), (3, 100, 2, 16), (4, 64, 1, 32)]:
        qkv = torch.randn(atoms, tokens, 3 * heads * dim, generator=g)
        mask = torch.log(torch.rand(atoms, tokens, tokens, generator=g).clamp_min(1e-15))
        mask[0, 1, :] = float("-inf")
        mask[0, 1, 3] = 0.7  # one allowed key: its value, exactly
        grad = torch.randn(atoms, tokens, heads * dim, generator=g)
        q, m = qkv.clone().requires_grad_(), mask.clone().requires_grad_()
        y = tc_attention(q, m, heads, dim**-0.5)
        y.backward(grad)
        q64, m64 = qkv.double().requires_grad_(), mask.double().requires_grad_()
        x = q64.reshape(atoms, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4)
        p = torch.softmax(x[0] @ x[1].transpose(-1, -2) * dim**-0.5 + m64[:, None], -1)
        exact = (p @ x[2]).transpose(1, 2).reshape(atoms, tokens, heads * dim)
        exact.backward(grad.double())
        assert torch.equal(y[0, 1], qkv[0, 3, 2 * heads * dim :])
        # FP32 sums of <= 2T terms of size <= max|v| (|p| <= 1), twice over (scores, then p @ v)
        bound = 8 * tokens * u * x[2].abs().max().item()
        assert (y.double() - exact).abs().max() <= bound, (atoms, tokens)
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        assert rel(q.grad, q64.grad) < 64 * tokens * u and rel(m.grad, m64.grad) < 64 * tokens * u, (atoms, tokens)

    # PET (the bundled demo model) with the kernels against torch's SDPA: same energy, forces, stress
    pet, lean, atoms, after = same_pet_after(lambda pet: len(swap_attention_blocks(pet)) == 4)
    import sys
    assert "torch._dynamo" not in sys.modules  # eager: no custom-op call (its first one imports dynamo, 0.5 s)
    recompute_gnn_layers(pet)  # low_memory=True: the layers run their forward again in the backward
    recomputed = lean.compute([atoms], PROPERTIES)[0]
    assert np.array_equal(recomputed["forces"], after["forces"])

    # heads too wide for the kernels: metatrain's own attention, with a warning that says why
    import warnings
    from metatrain.pet.modules.transformer import AttentionBlock
    block = AttentionBlock(256, 2, 1.0)
    x, factors = torch.randn(3, 10, 256, generator=g), torch.rand(3, 10, 10, generator=g)
    expected = block(x, factors, False)
    swap_attention_blocks(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(block(x, factors, False), expected)
    assert any("heads of 128 are wider than the kernels' 64" in str(w.message) for w in caught), [str(w.message) for w in caught]
    print("interpreter attention ok")
    """
)


def test_attention_kernels_in_the_triton_interpreter():
    interpret(ATTENTION_SCRIPT, "interpreter attention ok")


PACKED_SCRIPT = SAME_PET_AFTER + textwrap.dedent(
    """
    import numpy as np
    import torch
    from ase_tcfp32._kernels.attention import Sequences
    from ase_tcfp32._attention import packed_attention_in_torch, tc_attention_packed

    g = torch.Generator().manual_seed(0)
    u = 2.0**-24
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()

    # the blocks' order: as many (short, long) pairs that fit first as a brute-force matching finds
    from ase_tcfp32._kernels.attention import FIT_CHUNK, fit_blocks

    def most_pairs(lengths, block):
        short, long = [x for x in lengths if x <= block // 2], [x for x in lengths if x > block // 2]
        if not long or not short:
            return 0
        best = most_pairs(short + long[1:], block)  # the first long one alone, or with a short one it fits with
        for i, x in enumerate(short):
            if x + long[0] <= block:
                best = max(best, 1 + most_pairs(short[:i] + short[i + 1 :] + long[1:], block))
        return best

    rng = np.random.default_rng(0)
    for trial in range(12):
        block = (64, 128)[trial % 2]
        counts = torch.tensor(rng.integers(0, block, rng.integers(1, 9)) if trial % 3 else rng.integers(block // 3, block // 3 * 2, 8))
        blocks = fit_blocks(Sequences(torch.cumsum(counts, 0) - counts, counts, counts.sum(), int(counts.max()) + 1), block)
        assert sorted(blocks.order.tolist()) == list(range(len(counts)))
        ordered, pairs = (counts + 1)[blocks.order].tolist(), 0
        while (2 * pairs + 1 < len(ordered) and ordered[2 * pairs] <= block // 2 < ordered[2 * pairs + 1]
               and ordered[2 * pairs] + ordered[2 * pairs + 1] <= block):
            pairs += 1
        assert pairs == most_pairs((counts + 1).tolist(), block), (counts, ordered)

    # the blocks: next-fit over that order, chunk by chunk, against Python's
    for atoms, most, tokens, block in [(300, 38, 41, 64), (130, 20, 21, 64), (3, 99, 100, 128), (129, 0, 1, 64)]:
        counts = torch.randint(0, most + 1, (atoms,), generator=g)
        blocks = fit_blocks(Sequences(torch.cumsum(counts, 0) - counts, counts, counts.sum(), tokens), block)
        lengths = (counts + 1).clamp_max(tokens)
        chunks = blocks.order.split(FIT_CHUNK)
        assert all(torch.equal(c.sort().values, torch.arange(len(c)) + k * FIT_CHUNK) for k, c in enumerate(chunks))
        ordered, expected = lengths[blocks.order].tolist(), []
        slots = -(-min(FIT_CHUNK, atoms) // (block // tokens))
        for first in range(0, atoms, FIT_CHUNK):
            chunk = [[first, 0]]
            for p in range(first, min(first + FIT_CHUNK, atoms)):
                if sum(ordered[chunk[-1][0] : p]) + ordered[p] > block:
                    chunk.append([p, 0])
                chunk[-1][1] += 1
            expected += chunk + [[None, 0]] * (slots - len(chunk))
        found = blocks.table.tolist()
        assert len(found) == len(expected) and all(f[1] == e[1] and (e[1] == 0 or f[0] == e[0]) for f, e in zip(found, expected))

    # 3, 2 and 1 sequences per block, heads of 16 to 48, an atom without neighbors, 5 spare rows
    for atoms, heads, dim, most in [(7, 8, 32, 20), (5, 2, 48, 12), (3, 2, 16, 99), (6, 1, 32, 63)]:
        counts = torch.randint(0, most + 1, (atoms,), generator=g)
        counts[0], counts[1] = most, 0
        first = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())
        qkv = torch.randn(total + 5, 3 * heads * dim, generator=g)
        node_qkv = torch.randn(atoms, 3 * heads * dim, generator=g)
        bias = torch.log(torch.rand(total + 5, generator=g).clamp_min(1e-15))
        bias[first[2] : first[2] + counts[2]] = float("-inf")  # atom 2 attends to its center only
        sequences = Sequences(first, counts, torch.tensor(total), most + 1)
        inputs = [t.clone().requires_grad_() for t in (qkv, node_qkv, bias)]
        out, node_out = tc_attention_packed(*inputs, sequences, heads, dim**-0.5)
        grads = torch.randn_like(out), torch.randn_like(node_out)
        torch.autograd.backward([out, node_out], grads)
        exact_inputs = [t.double().requires_grad_() for t in (qkv, node_qkv, bias)]
        exact, node_exact = packed_attention_in_torch(*exact_inputs, sequences, heads, dim**-0.5)
        torch.autograd.backward([exact, node_exact], [t.double() for t in grads])
        values = node_qkv[2, 2 * heads * dim :]
        assert torch.equal(out[first[2] : first[2] + counts[2]], values.expand(int(counts[2]), -1)) and torch.equal(node_out[2], values)
        assert not out[total:].any() and not inputs[0].grad[total:].any() and not inputs[2].grad[total:].any()
        # FP32 sums of <= 2T terms of size <= max|v| (|p| <= 1), twice over (scores, then p @ v)
        bound = 8 * (most + 1) * u * qkv[:, 2 * heads * dim :].abs().max().item()
        assert (out.double() - exact).abs().max() <= bound and (node_out.double() - node_exact).abs().max() <= bound
        for mine, reference, rows in zip(inputs, exact_inputs, (total, atoms, total)):
            assert rel(mine.grad[:rows], reference.grad[:rows]) < 64 * (most + 1) * u

    # sequences longer than the kernels take (heads of 48: 64 tokens): torch's expression, with a warning that says why
    import warnings
    counts = torch.tensor([70, 3])
    long = Sequences(torch.tensor([0, 70]), counts, torch.tensor(73), 71)
    qkv, node_qkv, bias = torch.randn(73, 3 * 96, generator=g), torch.randn(2, 3 * 96, generator=g), torch.zeros(73)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = tc_attention_packed(qkv, node_qkv, bias, long, 2, 0.1)
    assert any("at most 64 tokens with heads of 48, these sequences have up to 71" in str(w.message) for w in caught)
    assert all(torch.equal(a, b) for a, b in zip(found, packed_attention_in_torch(qkv, node_qkv, bias, long, 2, 0.1)))

    # the bundled demo model on packed rows, with the kernels, against metatrain's table
    from ase_tcfp32._engines import PROPERTIES
    from ase_tcfp32._lean import LeanPET
    from ase_tcfp32.models import load_pet
    from ase_tcfp32.validation import water_box

    pet = load_pet("pet-demo-chgnet", "latest")
    atoms = water_box(8)
    atoms.rattle(0.05, seed=1)
    results = []
    for packed in (False, True):
        lean = LeanPET(pet, torch.device("cpu"), 2.0, 0, None, packed=packed)
        lean._solver_kernel = None  # metatrain's solver: the cutoff kernel has its own test (and is slow interpreted)
        results.append(lean.compute([atoms], PROPERTIES)[0])
    before, after = results
    exact = LeanPET(load_pet("pet-demo-chgnet", "latest").double(), torch.device("cpu"), 2.0, 0, None)
    no_further(after, before, exact.compute([atoms], PROPERTIES)[0], atoms)
    print("interpreter packed attention ok")
    """
)


def test_packed_attention_kernels_in_the_triton_interpreter():
    interpret(PACKED_SCRIPT, "interpreter packed attention ok")


SWIGLU_SCRIPT = SAME_PET_AFTER + textwrap.dedent(
    """
    from ase_tcfp32._fused import swap_feed_forwards, swiglu

    g = torch.Generator().manual_seed(0)
    u = 2.0**-24
    # rows and columns that fill no tile, several tiles, a tile exactly; extremes of the gate
    for shape in [(1, 2), (37, 2 * 300), (3, 5, 2 * 40), (16, 2 * 256), (0, 8)]:
        y = torch.randn(*shape, generator=g) * 4
        if y.numel() > 10:
            y.view(-1, shape[-1])[0, shape[-1] // 2 :][:5] = torch.tensor([90.0, -90.0, float("inf"), -float("inf"), float("nan")])
            y.view(-1, shape[-1])[1, 0] = float("inf")
        grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g)
        ours = y.clone().requires_grad_()
        h = swiglu(ours)
        h.backward(grad)
        v, gate = y.chunk(2, dim=-1)
        plain = y.clone().requires_grad_()
        expected = (lambda a, b: a * torch.sigmoid(b))(*plain.chunk(2, dim=-1))
        expected.backward(grad)
        assert h.shape == expected.shape, shape
        assert torch.equal(torch.isnan(h), torch.isnan(expected)) and torch.equal(torch.isnan(ours.grad), torch.isnan(plain.grad)), shape
        finite = torch.isfinite(y).all(-1, keepdim=True).expand_as(y).chunk(2, dim=-1)[0]
        # FP64: exp, 1 + e, the division and the products: a few roundings each
        s64 = torch.sigmoid(gate.double())
        assert ((h.double() - v.double() * s64)[finite].abs() <= 8 * u * (v.double() * s64)[finite].abs()).all(), shape
        dv, dg = ours.grad.chunk(2, dim=-1)
        scale = (grad.double() * v.double()).abs()
        assert ((dv.double() - grad.double() * s64)[finite].abs() <= 8 * u * (grad.double() * s64)[finite].abs()).all(), shape
        assert ((dg.double() - grad.double() * v.double() * s64 * (1 - s64))[finite].abs() <= 8 * u * scale[finite]).all(), shape

    # PET (the bundled demo model) with the fused SwiGLU against metatrain's: same energy, forces, stress
    same_pet_after(lambda pet: len(swap_feed_forwards(pet)) > 0)
    print("interpreter swiglu ok")
    """
)


def test_swiglu_kernels_in_the_triton_interpreter():
    interpret(SWIGLU_SCRIPT, "interpreter swiglu ok")


def test_narrow_products_in_the_triton_interpreter():
    """:func:`helpers.check_narrow` under Triton's interpreter (CPU)."""
    script = f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
    interpret(script + "from helpers import check_narrow\ncheck_narrow('cpu')\nprint('narrow ok')", "narrow ok")


COMBINATION_SCRIPT = SAME_PET_AFTER + textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {os.path.dirname(__file__)!r})
    from helpers import check_combination
    from ase_tcfp32._table import swap_backends

    check_combination("cpu")

    # PET (the bundled demo model) with the fused combination against metatrain's: same energy, forces, stress
    same_pet_after(lambda pet: swap_backends(pet) == ["backend"])
    assert "torch._dynamo" not in sys.modules
    print("interpreter combination ok")
    """
)


def test_message_combination_kernels_in_the_triton_interpreter():
    """LayerNorm(cat(o, o[reverse])) and its gradient against FP64 on random involutions
    (padding slots their own reverse); the demo PET with the swapped backend."""
    interpret(COMBINATION_SCRIPT, "interpreter combination ok")


PRE_NORM_SCRIPT = SAME_PET_AFTER + textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {os.path.dirname(__file__)!r})
    from helpers import check_pre_norm

    check_pre_norm("cpu")

    # the demo PET on packed rows (lean engine): the same energy, forces and stress with the
    # transformer layers' norms in pre_norm's kernels as with the norms one by one
    import numpy as np
    import torch
    from ase_tcfp32 import _packed
    from ase_tcfp32._engines import PROPERTIES
    from ase_tcfp32._lean import LeanPET
    from ase_tcfp32.models import load_pet
    from ase_tcfp32.validation import water_box

    atoms = water_box(4)  # 12 atoms: the interpreter's time grows with the rows
    atoms.rattle(0.05, seed=1)
    lean = LeanPET(load_pet("pet-demo-chgnet", "latest"), torch.device("cpu"), 2.0, 0, None, packed=True)
    lean._solver_kernel = None
    fused_calls, pre_norm = [], _packed.pre_norm
    def counted(x, norm):  # how many ran in pre_norm's kernels (no norm left to the layer)
        out = pre_norm(x, norm)
        fused_calls.append(out[2] is None)
        return out

    _packed.pre_norm = counted
    fused = lean.compute([atoms], PROPERTIES)[0]
    assert sum(fused_calls) == 12  # 2 GNN layers x 2 transformer layers x (attention, feed-forward, node update)
    # in pieces, one GNN layer at a time (its own backward pass): the same results
    from ase_tcfp32._layerwise import Pieces

    pieces = LeanPET(lean.pet, torch.device("cpu"), 2.0, 0, None, packed=True, pieces=Pieces(0, 7, 0))
    pieces._solver_kernel = None
    in_pieces = pieces.compute([atoms], PROPERTIES)[0]
    _packed.pre_norm = lambda x, norm: (x, x, norm)
    plain = lean.compute([atoms], PROPERTIES)[0]
    exact = LeanPET(load_pet("pet-demo-chgnet", "latest").double(), torch.device("cpu"), 2.0, 0, None, packed=True)
    exact = exact.compute([atoms], PROPERTIES)[0]
    for other in (fused, in_pieces):
        no_further(other, plain, exact, atoms)
    print("interpreter pre-norm ok")
    """
)


def test_pre_norm_kernels_in_the_triton_interpreter():
    """RMSNorm(x) next to x's residual use, and x's gradient through both, against FP64."""
    interpret(PRE_NORM_SCRIPT, "interpreter pre-norm ok")


CUTOFFS_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from metatrain.pet.modules.adaptive_cutoff import get_adaptive_cutoffs_solver
    from metatrain.pet.modules.utilities import cutoff_func_bump
    from ase_tcfp32._kernels import segments
    from ase_tcfp32._kernels.cutoffs import adaptive_cutoffs
    from ase_tcfp32._neighbors import build_pairs
    from ase_tcfp32.validation import water_box

    calls = []  # the neighbor counts summed per atom in the segment kernels, both ways
    for name in ("sum_rows", "gather_rows"):
        kernel = getattr(segments, name)
        setattr(segments, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))

    for molecules, skin, target in [(8, 0.5, 24), (8, 2.0, 16)]:
        atoms = water_box(molecules, seed=molecules)
        atoms.rattle(0.1, seed=2)
        positions, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
        pairs = build_pairs(positions, atoms.cell.array[None], np.array([atoms.pbc]), [len(atoms)], 8.0 + skin, 0)
        vectors = positions[pairs.neighbors] - positions[pairs.centers] + pairs.shifts.double() @ cell
        far = torch.tensor(1e6, dtype=torch.float64)  # the padding pairs, as the lean engine places them
        distances = torch.where(pairs.valid, vectors.norm(dim=1), far).float().requires_grad_()
        ours = adaptive_cutoffs(pairs.centers, distances, pairs.first, target, 8.0, 1.0, cutoff_func_bump)
        theirs = get_adaptive_cutoffs_solver(pairs.centers, distances, target, len(atoms), 8.0, 1.0)
        (grad,) = torch.autograd.grad(ours.sum(), distances)
        (expected,) = torch.autograd.grad(theirs.sum(), distances)
        u = 2.0**-24
        assert (ours - theirs).abs().max() <= 8 * u * 8.0, (ours - theirs).abs().max()
        assert (grad - expected).abs().max() <= 64 * u * expected.abs().max(), (grad - expected).abs().max()
    assert calls == ["sum_rows", "gather_rows"] * 2, calls
    import sys
    assert "torch._dynamo" not in sys.modules  # eager code calls the kernel, not its custom op (0.5 s import)
    print("interpreter cutoffs ok")
    """
)


def test_adaptive_cutoff_kernel_in_the_triton_interpreter():
    """The solver kernel against metatrain's own: cutoffs and their gradients to FP32 rounding
    (the counts summed per atom in the segment kernels); called eagerly, it does not import
    ``torch._dynamo``."""
    interpret(CUTOFFS_SCRIPT, "interpreter cutoffs ok")


PAIRS_SCRIPT = textwrap.dedent(
    """
    import ase.build
    import numpy as np
    import torch
    from ase_tcfp32._neighbors import VIRIAL_BINS, Structures, _searched, build_pairs, images_needed
    from ase_tcfp32.validation import water_box

    def listed(pairs):  # each real pair with its reverse's key, offsets and structure, in a canonical order
        keys = torch.cat([pairs.centers[:, None], pairs.neighbors[:, None], pairs.shifts], 1)
        rows = torch.cat([keys, keys[pairs.reverse], pairs.offsets.double(), (pairs.bins // VIRIAL_BINS)[:, None]], 1)
        return sorted(map(tuple, rows[: pairs.count].tolist()))

    def padding(pairs):
        return [t[pairs.count :] for t in (pairs.centers, pairs.neighbors, pairs.shifts, pairs.bins, pairs.reverse)]

    rng = np.random.default_rng(0)
    water = water_box(8, seed=1)
    water.positions += [7.3, -13.0, 30.0]  # outside the cell
    triclinic = water_box(8, seed=3)
    triclinic.set_cell(triclinic.cell.array + [[0, 0, 0], [2.5, 0, 0], [1.0, 1.5, 0]], scale_atoms=False)
    pt = ase.build.bulk("Pt", "fcc", a=3.92, cubic=True)  # a 3.9 A cell: images up to 3 cells away
    for atoms, cutoff in [(water, 5.5), (triclinic, 6.0), (pt, 10.0)]:
        beads = []
        for _ in range(2):
            bead = atoms.copy()
            bead.positions += rng.normal(scale=0.1, size=bead.positions.shape)
            beads.append(bead)
        batch = Structures.of(beads)
        positions = torch.tensor(batch.positions)
        theirs = build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, cutoff, 0)  # vesin's, on the CPU
        reach = images_needed(batch.cells[0], cutoff)
        ours = _searched(positions.view(2, len(atoms), 3), batch.cells, cutoff, reach, 0, None)
        assert ours.count == theirs.count and ours.valid.numel() == theirs.valid.numel()
        assert torch.equal(ours.first, theirs.first) and torch.equal(ours.centers, theirs.centers)
        assert torch.equal(ours.valid, theirs.valid) and listed(ours) == listed(theirs)
        assert all(torch.equal(a, b) for a, b in zip(padding(ours), padding(theirs)))
        if atoms is not water:
            continue
        # into an earlier list's larger buffers (offsets in float32): written there, padded
        room = theirs.valid.numel() + 1024
        earlier = _searched(positions.view(2, len(atoms), 3), batch.cells, cutoff, reach, room, None)
        earlier = earlier._replace(offsets=earlier.offsets.float())
        fewer = build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, cutoff - 1.0, 0)
        again = _searched(positions.view(2, len(atoms), 3), batch.cells, cutoff - 1.0, reach, room, earlier)
        assert again.valid is earlier.valid and again.count == fewer.count and again.offsets.dtype == torch.float32
        assert torch.equal(again.first, fewer.first) and int(again.valid.sum()) == fewer.count
        assert [row[:10] for row in listed(again)] == [row[:10] for row in listed(fewer)]
        assert torch.equal(again.reverse[again.count :], torch.arange(again.count, room))
        # more pairs than an earlier list's buffers hold: new tensors, 10% more room
        small = _searched(positions.view(2, len(atoms), 3), batch.cells, cutoff - 1.5, reach, 0, None)
        grown = _searched(positions.view(2, len(atoms), 3), batch.cells, cutoff, reach, small.valid.numel(), small)
        assert grown.valid is not small.valid and grown.count == theirs.count
        assert grown.valid.numel() >= 1.1 * grown.count and listed(grown) == listed(theirs)

    # a Verlet list rebuilt in its buffers without the host reading the count (multiple time
    # stepping's outer steps): the list of the new positions where it fits, dropped where not
    import ase_tcfp32._neighbors as neighbors

    neighbors._kernel_searches = lambda device: True  # the kernels' path, here under the interpreter
    water = water_box(8, seed=2)
    verlet = neighbors.VerletList(4.0, torch.device("cpu"), torch.float32)
    verlet.skin = 1.0
    verlet.update(Structures.of([water]), in_place=False)
    buffers = verlet.pairs
    moved = water.copy()
    moved.positions += rng.normal(scale=0.2, size=moved.positions.shape)
    later = Structures.of([moved])
    rebuild = verlet.rebuilder(later)
    count = rebuild(torch.tensor(later.positions))
    assert verlet.pairs.valid is buffers.valid and verlet.rebuilds == 1  # in place; nothing settled yet
    verlet.settle(int(count), later.positions)
    fresh = build_pairs(torch.tensor(later.positions), later.cells, later.pbcs, later.sizes, 5.0, 0)
    fresh = fresh._replace(offsets=fresh.offsets.float())  # the list's own offsets are in the model's type
    assert verlet.pairs.valid is buffers.valid and verlet.pairs.count == fresh.count and verlet.rebuilds == 2
    assert torch.equal(verlet.pairs.first, fresh.first) and listed(verlet.pairs) == listed(fresh)
    assert not verlet.stale(later) and np.array_equal(verlet.reference, later.positions)
    verlet.skin = 2.5  # more pairs than the buffers hold: written up to them, then dropped
    capacity = verlet.pairs.valid.numel()
    count = verlet.rebuilder(later)(torch.tensor(later.positions))
    assert int(count) > capacity and verlet.pairs.valid.numel() == capacity
    verlet.settle(int(count), later.positions)
    assert verlet.pairs is None and verlet.stale(later) and verlet.rebuilds == 2
    verlet.update(later, in_place=False)  # positions not to be trusted: the list is dropped too
    verlet.rebuilder(later)(torch.tensor(later.positions))
    verlet.settle(None, later.positions)
    assert verlet.pairs is None and verlet.rebuilds == 3
    print("interpreter pairs ok")
    """
)


def test_pair_search_kernels_in_the_triton_interpreter():
    """The GPU's search of small periodic cells of one size (:mod:`ase_tcfp32._kernels.pairs`)
    gives vesin's list: the same pairs, shifts, offsets, reverses, structures, order by
    center and padding, for beads of a box whose atoms lie outside it, of a triclinic cell,
    and of a 3.9 Å cell whose atoms see their own images 3 cells away; written into an
    earlier list's larger buffers where it fits (float32 offsets), into new ones where not;
    a Verlet list rebuilt in its buffers before the host reads the count
    (``VerletList.rebuilder``), kept where it fits and dropped where it does not."""
    interpret(PAIRS_SCRIPT, "interpreter pairs ok")
