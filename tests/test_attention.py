"""The attention swap on CPU: which calculators use it, what it changes in a model and what not;
on the GPU (``gpu``-marked) the kernels against torch FP32 SDPA and FP64, and in PET."""

import copy
import os
import pickle
import textwrap

import numpy as np
import pytest
import torch
from helpers import rel_error
from test_triton_interpreter import interpret

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._attention import on_tensor_cores, swap_attention_blocks

pytest.importorskip("triton")


def test_only_fp32_accurate_precisions_on_cuda_use_tensor_core_attention():
    assert (
        on_tensor_cores("fp16x3", "cuda") and on_tensor_cores("tf32x3", "cuda:1") and on_tensor_cores("bf16x9", "cuda")
    )
    assert not on_tensor_cores("fp32", "cuda") and not on_tensor_cores("tf32", "cuda")
    assert not on_tensor_cores("tf32x3", "cpu")


def test_the_swap_keeps_parameters_and_state_dict_and_survives_copies(tiny_ckpt):
    from ase_tcfp32._attention import TCAttentionBlock
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    names = swap_attention_blocks(pet)
    assert names and all(type(pet.get_submodule(n)) is TCAttentionBlock for n in names)
    assert swap_attention_blocks(pet) == names  # idempotent
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.get_submodule(names[0])) is TCAttentionBlock
    swap_attention_blocks(pet, False)
    assert all(type(pet.get_submodule(n)).__name__ == "AttentionBlock" for n in names)


def test_a_calculator_on_cpu_keeps_torch_sdpa(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32")
    assert calc.attention == "torch SDPA"
    assert all(type(m).__name__ != "TCAttentionBlock" for m in calc.pet.modules())
    assert "attention" in calc._repr_html_()


def test_tc_attention_refuses_other_dtypes():
    from ase_tcfp32._attention import tc_attention

    with pytest.raises(TypeError, match="float32"):
        tc_attention(torch.zeros(2, 3, 48, dtype=torch.float64), torch.zeros(2, 3, 3, dtype=torch.float64), 2, 1.0)


def test_the_kernels_refuse_sequences_longer_than_they_take_before_launching():
    from ase_tcfp32._kernels import attention

    assert attention.max_tokens(32) == 128 and attention.max_tokens(48) == 64 and attention.max_tokens(80) == 0
    with pytest.raises(ValueError, match="at most 64 tokens with heads of 48, not 65"):
        attention.forward(torch.zeros(2, 65, 3 * 2 * 48), torch.zeros(2, 65, 65), 2, 1.0)
    with pytest.raises(ValueError, match=r"qkv \[B, T, 3\*H\*D\] and mask \[B, T, T\] expected"):
        attention.backward(torch.zeros(2, 5, 64), torch.zeros(2, 5, 96), torch.zeros(2, 5, 4), 2, 1.0)


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["metatomic", "lean"])
def test_systems_past_the_sdpa_grid_limit(engine):
    """66,000 atoms: in FP32, PET's SDPA backward runs in chunks of 65,535 atoms (metatrain
    splits the batch and warns); our attention has no such limit. Energies and forces of
    tf32x3 agree with FP32 in both engines."""
    import warnings

    from ase_tcfp32.validation import water_box

    atoms = water_box(22_000, seed=1)
    results = {}
    for precision in ("fp32", "tf32x3"):
        atoms.calc = TCPETCalculator("pet-demo-chgnet", precision=precision, device="cuda", engine=engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[precision] = atoms.get_potential_energy(), atoms.get_forces()
        chunked = any("CUDA grid dimension" in str(w.message) for w in caught)
        if precision == "tf32x3":
            assert not chunked
        elif engine == "lean":
            assert chunked
        torch.cuda.empty_cache()
    (e32, f32), (e3, f3) = results["fp32"], results["tf32x3"]
    assert np.isfinite(f3).all() and len(f3) == 66_000
    assert abs(e3 - e32) / len(atoms) < 1e-5
    assert np.abs(f3 - f32).max() < 1e-3


def _attention_inputs(atoms: int, tokens: int, head_dim: int, seed: int = 0):
    """PET-like attention inputs: qkv [B, T, 3*8*D], the log of per-key cutoff weights
    repeated over the rows (padding keys at PET's clamp, 1e-15) and the scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(atoms, tokens, 3 * 8 * head_dim, device="cuda", generator=g)
    weights = torch.rand(atoms, tokens, device="cuda", generator=g) ** 2
    weights[:, 0], weights[:, -3:] = 1.0, 0.0
    mask = torch.log(torch.clamp(weights[:, None, :].repeat(1, tokens, 1), 1e-15))
    return qkv, mask, head_dim**-0.5


def _attention_fp64(qkv, mask, scale):
    x = qkv.reshape(*qkv.shape[:2], 3, 8, -1).permute(2, 0, 3, 1, 4)
    p = torch.softmax(x[0] @ x[1].transpose(-1, -2) * scale + mask[:, None], -1)
    return (p @ x[2]).transpose(1, 2).reshape(*qkv.shape[:2], -1)


def _per_head_errors(y, exact):
    """Normwise relative error of each (atom, head) output."""
    split = lambda t: t.reshape(*t.shape[:2], 8, -1).transpose(1, 2).flatten(2)  # noqa: E731
    return (split(y.double()) - split(exact)).norm(dim=-1) / split(exact).norm(dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,head_dim", [(40, 32), (52, 48), (17, 16), (100, 32)])
def test_tensor_core_attention_is_as_accurate_as_torch_fp32_sdpa(tokens, head_dim):
    """Per (atom, head), forward and gradients: error vs FP64 at most torch FP32 SDPA's
    (what metatrain calls; 3xTF32 on sm80 kernels) plus 2 units of 2^-24."""
    from ase_tcfp32._attention import tc_attention

    qkv, mask, scale = _attention_inputs(1000, tokens, head_dim)
    grad = torch.randn(*qkv.shape[:2], qkv.shape[2] // 3, device="cuda")
    results = {}
    for name in ("ours", "sdpa"):
        q, m = qkv.clone().requires_grad_(), mask.clone().requires_grad_()
        if name == "ours":
            y = tc_attention(q, m, 8, scale)
        else:
            x = q.reshape(*q.shape[:2], 3, 8, -1).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=m[:, None], scale=scale)
            y = y.transpose(1, 2).reshape(*q.shape[:2], -1)
        y.backward(grad)
        results[name] = y.detach(), q.grad, m.grad
    q64, m64 = qkv.double().requires_grad_(), mask.double().requires_grad_()
    exact = _attention_fp64(q64, m64, scale)
    exact.backward(grad.double())
    (y, dq, dm), (y_sdpa, dq_sdpa, dm_sdpa) = results["ours"], results["sdpa"]
    ulp = 2.0**-24
    assert _per_head_errors(y, exact).max() <= _per_head_errors(y_sdpa, exact).max() + 2 * ulp
    assert rel_error(dq, q64.grad) <= rel_error(dq_sdpa, q64.grad) + 2 * ulp
    assert rel_error(dm, m64.grad) <= rel_error(dm_sdpa, m64.grad) + 2 * ulp


@pytest.mark.gpu
def test_tensor_core_attention_one_allowed_key_gives_its_value_exactly():
    """A row whose mask is -inf but for one key returns that key's value bit for bit."""
    from ase_tcfp32._attention import tc_attention

    qkv, mask, scale = _attention_inputs(300, 41, 32, seed=3)
    keys = torch.randint(0, 41, (300, 41), device="cuda")
    mask = torch.full_like(mask, float("-inf")).scatter_(2, keys[..., None], 0.5)
    y = tc_attention(qkv, mask, 8, scale)
    values = qkv[..., 2 * 256 :].gather(1, keys[..., None].expand(-1, -1, 256))
    assert torch.equal(y, values)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 48])
def test_packed_attention_is_as_accurate_as_torch_fp32(head_dim):
    """The kernels on packed sequences (PET-like: 24-40 neighbors, 8 heads) against the
    same sequences padded and attended by torch in FP32 and FP64: normwise per sequence,
    forward and gradients, within torch FP32's error plus 2 units of 2^-24; an atom whose
    neighbors are all masked gets its center token's value exactly; spare rows are zero."""
    from ase_tcfp32._attention import packed_attention_in_torch, tc_attention_packed
    from ase_tcfp32._kernels.attention import Sequences

    g = torch.Generator(device="cuda").manual_seed(0)
    atoms, width = 2000, 3 * 8 * head_dim
    counts = torch.randint(24, 41, (atoms,), device="cuda", generator=g)
    first = torch.cumsum(counts, 0) - counts
    total = int(counts.sum())
    qkv = torch.randn(total + 100, width, device="cuda", generator=g)
    node_qkv = torch.randn(atoms, width, device="cuda", generator=g)
    bias = torch.log(torch.clamp(torch.rand(total + 100, device="cuda", generator=g) ** 2, 1e-15))
    bias[first[5] : first[5] + counts[5]] = float("-inf")
    sequences = Sequences(first, counts, torch.tensor(total, device="cuda"), 42)
    grads = (
        torch.randn(total + 100, width // 3, device="cuda", generator=g),
        torch.randn(atoms, width // 3, device="cuda", generator=g),
    )
    results = {}
    for name, attend, dtype in (
        ("ours", tc_attention_packed, torch.float32),
        ("torch", packed_attention_in_torch, torch.float32),
        ("exact", packed_attention_in_torch, torch.float64),
    ):
        inputs = [t.detach().to(dtype).clone().requires_grad_() for t in (qkv, node_qkv, bias)]
        outputs = attend(*inputs, sequences, 8, head_dim**-0.5)
        torch.autograd.backward(outputs, [t.to(dtype) for t in grads])
        results[name] = [o.detach() for o in outputs] + [t.grad for t in inputs]
    ulp = 2.0**-24
    for k, rows in enumerate((total, atoms, total, atoms, total)):  # out, node out, d qkv, d node qkv, d bias
        exact = results["exact"][k][:rows]
        assert rel_error(results["ours"][k][:rows], exact) <= rel_error(results["torch"][k][:rows], exact) + 2 * ulp, k
    out, node_out = results["ours"][:2]
    values = node_qkv[5, 2 * 8 * head_dim :]
    assert torch.equal(node_out[5], values) and torch.equal(
        out[first[5] : first[5] + counts[5]], values.expand(int(counts[5]), -1)
    )
    assert not out[total:].any() and not results["ours"][2][total:].any() and not results["ours"][4][total:].any()


def check_head_groups(device: str) -> None:
    """The packed kernels with each block's 8 heads in 1, 2 and 8 programs (and as many as
    :func:`head_groups` picks: 8 for so few blocks) on PET-like sequences (12-40 neighbors, an
    atom without any, one whose neighbors are all masked, 5 spare edge rows), heads of 16 and
    32: the outputs and qkv gradients bit for bit those of one program, the bias gradient
    within the float32 roundings of another order of the heads' sums (of the float64 heads'
    terms), the same bits when run again, all within 64 T units of 2^-24 of float64, and
    zero in the spare rows."""
    from ase_tcfp32._attention import packed_attention_in_torch
    from ase_tcfp32._kernels.attention import Sequences, backward_packed, forward_packed

    g = torch.Generator(device).manual_seed(0)
    u, heads, tokens = 2.0**-24, 8, 42
    counts = torch.tensor([40, 0, 24, 31, 12, 37, 28], device=device)
    atoms, first, total = len(counts), torch.cumsum(counts, 0) - counts, int(counts.sum())
    sequences = Sequences(first, counts, torch.tensor(total, device=device), tokens)
    for dim in (16, 32):
        scale = dim**-0.5
        qkv = torch.randn(total + 5, 3 * heads * dim, device=device, generator=g)
        node_qkv = torch.randn(atoms, 3 * heads * dim, device=device, generator=g)
        bias = torch.log(torch.rand(total + 5, device=device, generator=g).clamp_min(1e-15))
        bias[first[5] : first[5] + counts[5]] = float("-inf")
        grads = (
            torch.randn(total + 5, heads * dim, device=device, generator=g),
            torch.randn(atoms, heads * dim, device=device, generator=g),
        )
        found = {}
        for groups in (1, 2, 8, None):
            outputs = forward_packed(qkv, node_qkv, bias, sequences, heads, scale, groups=groups)
            found[groups] = [
                *outputs,
                *backward_packed(*grads, qkv, node_qkv, bias, sequences, heads, scale, groups=groups),
            ]
        again = backward_packed(*grads, qkv, node_qkv, bias, sequences, heads, scale, groups=8)
        assert all(torch.equal(a, b) for a, b in zip(again, found[8][2:], strict=True))
        inputs = [t.double().requires_grad_() for t in (qkv, node_qkv, bias)]
        exact = packed_attention_in_torch(*inputs, sequences, heads, scale)
        torch.autograd.backward(exact, [t.double() for t in grads])
        exact = [e.detach() for e in exact] + [t.grad for t in inputs]
        terms = 0  # each edge's sum over the heads of the magnitudes of its bias gradient in each
        for h in range(heads):
            alone = torch.zeros(heads * dim, dtype=torch.bool, device=device)
            alone[h * dim : (h + 1) * dim] = True  # head h's output gradients only
            outputs = packed_attention_in_torch(*inputs, sequences, heads, scale)
            (term,) = torch.autograd.grad(outputs, inputs[2], [torch.where(alone, t, 0).double() for t in grads])
            terms = terms + term.abs()
        one = found[1]
        for groups, results in found.items():
            assert all(torch.equal(a, b) for a, b in zip(results[:4], one[:4], strict=True)), (dim, groups)
            assert ((results[4] - one[4]).abs() <= 2 * heads * u * terms).all(), (dim, groups)
            for ours, reference, rows in zip(results, exact, (total, atoms, total, atoms, total), strict=True):
                assert rel_error(ours[:rows], reference[:rows]) < 64 * tokens * u, (dim, groups)
            assert not results[0][total:].any() and not results[2][total:].any() and not results[4][total:].any()


def test_packed_attention_head_groups_in_the_triton_interpreter():
    """:func:`check_head_groups` under Triton's interpreter (CPU)."""
    interpret(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from test_attention import check_head_groups

            check_head_groups("cpu")
            print("interpreter head groups ok")
            """
        ),
        "interpreter head groups ok",
    )


def test_the_attention_layers_of_an_evaluation_share_their_blocks():
    """The packed kernels' blocks are fitted once per set of sequences (an evaluation's),
    whatever the number of attention layers; new sequences get their own (Triton's
    interpreter)."""
    interpret(
        textwrap.dedent(
            """
            import torch
            from ase_tcfp32 import _attention
            from ase_tcfp32._kernels import attention

            launches = []
            fit = attention.fit_blocks
            attention.fit_blocks = lambda *args: launches.append(args) or fit(*args)
            counts = torch.tensor([30, 12, 0, 25])
            first = torch.cumsum(counts, 0) - counts
            sequences = attention.Sequences(first, counts, counts.sum(), 42)
            blocks = [_attention._blocks(sequences, 8, 32) for layer in range(3)]
            assert len(launches) == 1 and all(b is blocks[0] for b in blocks)
            again = attention.Sequences(first, counts.clone(), counts.sum(), 42)  # the next evaluation's
            assert _attention._blocks(again, 8, 32) is not blocks[0] and len(launches) == 2
            assert torch.equal(_attention._blocks(again, 8, 32).order, blocks[0].order)
            print("shared blocks ok")
            """
        ),
        "shared blocks ok",
    )


@pytest.mark.gpu
def test_packed_attention_head_groups_on_the_gpu():
    """:func:`check_head_groups` compiled for the GPU."""
    check_head_groups("cuda")


def test_the_heads_split_into_groups_only_when_the_blocks_cannot_fill_the_gpu():
    """One group from two programs per multiprocessor on (132 counted for CPU tensors), else
    the fewest groups that divide the heads and reach it, at most one a head; a padded
    head's backward one a head at every size; no others."""
    from ase_tcfp32._kernels.attention import Sequences, forward_packed, head_groups

    cpu = torch.device("cpu")
    assert [head_groups(slots, 8, cpu) for slots in (17280, 264, 263, 132, 66, 65, 1)] == [1, 1, 2, 2, 4, 8, 8]
    assert [head_groups(slots, 6, cpu) for slots in (100, 88, 87, 1)] == [3, 3, 6, 6]
    assert [head_groups(slots, 8, cpu, padded_backward=True) for slots in (17280, 1)] == [8, 8]
    counts = torch.tensor([3, 4])
    sequences = Sequences(torch.tensor([0, 3]), counts, torch.tensor(7), 5)
    for groups in (0, 3):
        with pytest.raises(ValueError, match=f"{groups} groups of 8 heads"):
            forward_packed(
                torch.zeros(7, 3 * 8 * 16),
                torch.zeros(2, 3 * 8 * 16),
                torch.zeros(7),
                sequences,
                8,
                0.25,
                groups=groups,
            )


@pytest.mark.gpu
def test_attention_blocks_on_the_gpu_pair_and_fill_as_python_does():
    """fit_blocks compiled for the GPU: each chunk's order is a permutation of its atoms that
    starts with as many (short, long) pairs that fit as the greedy matching finds (largest
    long one first, with the shortest short one left), and the blocks are Python's next-fit
    over that order; PET-like water lengths and mixed ones, 64- and 128-row blocks."""
    from ase_tcfp32._kernels.attention import FIT_CHUNK, Sequences, fit_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    for atoms, low, high, tokens, block in [(17280, 24, 39, 42, 64), (1000, 0, 39, 42, 64), (777, 30, 90, 100, 128)]:
        counts = torch.randint(low, high + 1, (atoms,), device="cuda", generator=g)
        blocks = fit_blocks(Sequences(torch.cumsum(counts, 0) - counts, counts, counts.sum(), tokens), block)
        lengths, order = (counts + 1).clamp_max(tokens).tolist(), blocks.order.tolist()
        table, slots, expected = blocks.table.tolist(), len(blocks.table) // -(-atoms // FIT_CHUNK), []
        for first in range(0, atoms, FIT_CHUNK):
            chunk = order[first : first + FIT_CHUNK]
            assert sorted(chunk) == list(range(first, first + len(chunk)))
            ordered = [lengths[a] for a in chunk]
            short = sorted(x for x in ordered if x <= block // 2)
            most = 0
            for x in sorted((x for x in ordered if x > block // 2), reverse=True):
                most += most < len(short) and short[most] + x <= block
            pairs = 0
            while (
                2 * pairs + 1 < len(ordered)
                and ordered[2 * pairs] <= block // 2 < ordered[2 * pairs + 1]
                and ordered[2 * pairs] + ordered[2 * pairs + 1] <= block
            ):
                pairs += 1
            assert pairs == most
            fitted = [[first, 0]]
            for p, x in enumerate(ordered, first):
                if sum(lengths[a] for a in order[fitted[-1][0] : p]) + x > block:
                    fitted.append([p, 0])
                fitted[-1][1] += 1
            expected += fitted + [[None, 0]] * (slots - len(fitted))
        assert all(f[1] == e[1] and (e[1] == 0 or f[0] == e[0]) for f, e in zip(table, expected, strict=True))


@pytest.mark.gpu
def test_tensor_core_attention_in_pet_matches_sdpa_in_every_engine(tiny_ckpt, water192):
    """tf32x3 with our attention, SwiGLU, message combination, folded compression and fused
    transformer layers (the default for FP32-accurate precisions) against the same precision with torch's SDPA and metatrain's
    code: energies, forces and stress to FP32 rounding, eager, compiled and in CUDA graphs."""
    from ase_tcfp32._attention import swap_attention_blocks
    from ase_tcfp32._folded import swap_cartesian_transformers
    from ase_tcfp32._fused import swap_feed_forwards
    from ase_tcfp32._table import swap_backends, swap_transformer_layers

    reference = water192.copy()
    reference.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine="metatomic")
    assert swap_attention_blocks(reference.calc.pet, False) and swap_feed_forwards(reference.calc.pet, False)
    assert swap_backends(reference.calc.pet, False) == ["backend"] and swap_cartesian_transformers(
        reference.calc.pet, False
    )
    assert swap_transformer_layers(reference.calc.pet, False)
    e0, f0, s0 = reference.get_potential_energy(), reference.get_forces(), reference.get_stress()
    for engine, compile in [("metatomic", False), ("lean", False), ("graphs", False), ("lean", True)]:
        atoms = water192.copy()
        atoms.calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", device="cuda", engine=engine, compile=compile)
        assert atoms.calc.attention.startswith("tensor cores")
        assert abs(atoms.get_potential_energy() - e0) / len(atoms) < 2e-6, (engine, compile)
        assert np.abs(atoms.get_forces() - f0).max() < 3e-5, (engine, compile)
        assert np.abs(atoms.get_stress() - s0).max() < 1e-6, (engine, compile)
