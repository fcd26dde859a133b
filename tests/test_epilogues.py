"""Linear layers fused with their bias, residual and activation (ase_tcfp32._epilogues and
the GEMM kernels' epilogues, ase_tcfp32._kernels.epilogue): the same values as the steps
one by one, on CPU (Triton's interpreter for the kernels' logic) and on the GPU (where the
tensor-core products and the hardware's exp2 run)."""

import contextlib
import textwrap

import numpy as np
import pytest
import torch
from test_triton_interpreter import interpret

from ase_tcfp32 import _epilogues, watchdog
from ase_tcfp32._kernels.epilogue import Embedding, activate, interleave
from ase_tcfp32.layers import TCLinear

U = 2.0**-24


def test_interleaved_swiglu_is_metatrains():
    """Interleaving the weight's rows (value i next to gate i) and activating pairs gives
    metatrain's ``v * sigmoid(g)`` of the halves ``[v | g]``."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(9, 6, generator=g), torch.randn(10, 6, generator=g), torch.randn(10, generator=g)
    value, gate = (x @ w.T + b).chunk(2, dim=-1)
    together = activate(x @ interleave(w).T + interleave(b), "swiglu")
    assert torch.allclose(together, value * torch.sigmoid(gate), rtol=1e-6, atol=1e-6)
    assert torch.equal(activate(x, "silu"), torch.nn.functional.silu(x)) and activate(x, None) is x


def test_composed_steps_on_cpu():
    """Without a fusing backend (CPU), :func:`linear` runs the layer, the residual and the
    activation one by one, with their gradients."""
    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(5, 8).double()
    x, r = torch.randn(7, 5, generator=g).double().requires_grad_(), torch.randn(7, 8, generator=g).double()
    y = _epilogues.linear(layer, x, residual=r, activation="silu")
    assert torch.equal(y, torch.nn.functional.silu(layer(x) + r))
    h = _epilogues.linear(layer, x, activation="swiglu")
    value, gate = layer(x).chunk(2, dim=-1)
    assert torch.allclose(h, value * torch.sigmoid(gate))
    h.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_the_watchdog_sees_plain_gemms():
    """A call the watchdog is due to check runs unfused; fused calls are counted."""
    layer = TCLinear(4, 4, precision="tf32x3", check_accuracy=3)
    assert watchdog.due(layer, "forward")  # the first call is checked
    watchdog.count_call(layer, "forward")
    assert not watchdog.due(layer, "forward")
    watchdog.count_call(layer, "forward")
    watchdog.count_call(layer, "forward")
    assert watchdog.due(layer, "forward")  # the fourth
    with watchdog.check_all():
        watchdog.count_call(layer, "forward")
        assert watchdog.due(layer, "forward")
    assert not watchdog.due(TCLinear(4, 4, precision="tf32x3"), "forward")  # off


INTERPRETED = textwrap.dedent(
    """
    import contextlib
    import torch
    from ase_tcfp32 import _epilogues, watchdog
    from ase_tcfp32._kernels.epilogue import activate, interleave
    from ase_tcfp32._kernels.triton_gemm import TritonBackend
    from ase_tcfp32.layers import TCLinear

    g = torch.Generator().manual_seed(0)
    u = 2.0**-24
    backend = TritonBackend("tf32x3")
    # the kernel: act(x w^T + b + r) against float64, for every activation, residual or not,
    # shapes that leave partial tiles (the interpreter's dots are FP32: this checks the logic)
    for m, k, n in [(37, 40, 20), (130, 64, 66), (129, 70, 130), (5, 0, 8)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        r = torch.randn(m, n, generator=g)
        for activation in (None, "silu", "swiglu"):
            weight, bias = (interleave(w), interleave(b)) if activation == "swiglu" else (w, b)
            z = x.double() @ weight.double().T + bias.double()
            scale = x.double().abs() @ weight.double().abs().T + bias.double().abs() + r.double().abs()
            for residual in ((None, r) if activation != "swiglu" else (None,)):
                y = backend.fused(x, backend.prepare(weight), bias, residual, activation)
                exact = activate(z + (0.0 if residual is None else residual.double()), activation)
                bound = (scale if activation != "swiglu" else scale.reshape(m, -1, 2).amax(-1)) * 8 * (k + 4) * u
                assert y.shape == exact.shape, (m, k, n, activation)
                assert ((y.double() - exact).abs() <= bound).all(), (m, k, n, activation, residual is not None)

    # the folded edge embeddings, computed in the kernel: table[index] + geometry @ matrix^T
    from ase_tcfp32._kernels.epilogue import Embedding
    x, w = torch.randn(150, 64, generator=g), torch.randn(40, 64, generator=g)
    table, geometry, matrix = (torch.randn(*shape, generator=g) for shape in ((5, 40), (150, 4), (40, 4)))
    embedded = Embedding(table, torch.randint(0, 5, (150,), generator=g), geometry, matrix)
    y = backend.fused(x, backend.prepare(w), None, embedded, "silu")
    exact = torch.nn.functional.silu(x.double() @ w.double().T + embedded.tensor().double())
    assert (y.double() - exact).abs().max() < 1e-4

    # _epilogues.linear with that backend: fused where it may be, the same values as unfused
    import ase_tcfp32.layers
    _epilogues.get_backend = ase_tcfp32.layers.get_backend = lambda precision, device, emulate: backend
    calls = []
    fused = backend.fused
    backend.fused = lambda *a, **kw: calls.append(a[3:]) or fused(*a, **kw)
    layer = TCLinear(48, 64, precision="tf32x3").requires_grad_(False)  # frozen, as models are loaded
    x, r = torch.randn(200, 48, generator=g), torch.randn(200, 64, generator=g)
    for activation in (None, "silu", "swiglu"):
        with torch.no_grad():
            y = _epilogues.linear(layer, x, r if activation != "swiglu" else None, activation)
            with _epilogues.unfused():
                expected = _epilogues.linear(layer, x, r if activation != "swiglu" else None, activation)
        assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5), activation
    assert len(calls) == 3
    # an RMS norm before the layer, its weight folded into the layer's: the norm's values
    norm = torch.nn.RMSNorm(48, eps=1e-5).requires_grad_(False)
    norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    for activation in (None, "swiglu"):
        with torch.no_grad():
            y = _epilogues.linear(layer, 3 * x, None, activation, norm)
            expected = _epilogues._composed(layer, 3 * x, None, activation, norm)
        assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5), activation
    assert len(calls) == 5
    # with gradients: the residual fused, its gradient and the input's as unfused
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    _epilogues.linear(layer, xg, rg).pow(2).sum().backward()
    assert len(calls) == 6
    xu, ru = x.clone().requires_grad_(), r.clone().requires_grad_()
    (layer(xu) + ru).pow(2).sum().backward()
    assert torch.allclose(xg.grad, xu.grad, rtol=1e-5, atol=1e-4) and torch.allclose(rg.grad, ru.grad, rtol=1e-5, atol=1e-4)
    # an activation with gradients, and a call the watchdog checks: unfused
    _epilogues.linear(layer, xg, rg, "silu")
    layer.check_accuracy = 1
    with torch.no_grad():
        _epilogues.linear(layer, x, r, "silu")
    assert len(calls) == 6
    # two layers with an activation between them, with gradients (_epilogues.pair): the first
    # kernel keeps the pre-activation; the same values and gradients as the steps one by one
    first = TCLinear(48, 64, precision="tf32x3").requires_grad_(False)
    table, matrix = torch.randn(5, 64, generator=g), torch.randn(64, 4, generator=g)
    index, geometry = torch.randint(0, 5, (200,), generator=g), torch.randn(200, 4, generator=g)
    # (the folded embeddings computed in the first kernel; "geometry": only they need gradients,
    # as in the first GNN layer, whose input messages do not depend on the positions)
    for activation, inner in (("silu", None), ("swiglu", None), ("silu", "embedding"), ("silu", "geometry")):
        second = TCLinear(32 if activation == "swiglu" else 64, 48, precision="tf32x3").requires_grad_(False)
        values = []
        for run in ("fused", "unfused"):
            xg, rg, gg = x.clone().requires_grad_(), x.clone().requires_grad_(), geometry.clone().requires_grad_()
            if inner == "geometry":
                xg, rg = xg.detach(), rg.detach()
            extra = None if inner is None else Embedding(table, index, gg, matrix)
            before = len(calls)
            with _epilogues.unfused() if run == "unfused" else contextlib.nullcontext():
                y = _epilogues.pair(first, second, xg, activation, extra, rg)
            y.pow(2).sum().backward()
            assert len(calls) == before + (2 if run == "fused" else 0), (activation, run)
            values.append([y, xg.grad, rg.grad, gg.grad])
        for fused_value, plain in zip(*values):
            assert (fused_value is None) == (plain is None), activation
            assert plain is None or torch.allclose(fused_value, plain, rtol=1e-5, atol=1e-4), activation
    # the folded embeddings' backward in one pass: SiLU's gradient and the K = 4 product's, against float64
    from ase_tcfp32._kernels import folded
    for m, n in [(37, 20), (300, 256), (5, 130)]:
        z, dh, mat = torch.randn(m, n, generator=g) * 4, torch.randn(m, n, generator=g), torch.randn(n, 4, generator=g)
        dz, dgeometry = folded.backward(dh, z, mat)
        s = torch.sigmoid(z.double())
        exact = dh.double() * s * (1 + z.double() * (1 - s))
        scale = dh.double().abs() * s * (1 + z.double().abs())  # 1 + z (1 - s) may cancel; 1 - s rounds
        assert ((dz.double() - exact).abs() <= 8 * u * scale + 1e-30).all(), (m, n)
        bound = exact.abs() @ mat.double().abs() * (n + 8) * u
        assert ((dgeometry.double() - exact @ mat.double()).abs() <= bound).all(), (m, n)
    # the kernel alone: the kept pre-activation ([v | g] for SwiGLU) against float64
    for m, k, n in [(37, 40, 20), (130, 64, 66)]:
        x1, w1, b1 = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        z_exact = x1.double() @ w1.double().T + b1.double()
        scale = x1.double().abs() @ w1.double().abs().T + b1.double().abs()
        for activation in ("silu", "swiglu"):
            weight, bias = (interleave(w1), interleave(b1)) if activation == "swiglu" else (w1, b1)
            h, z = backend.fused(x1, backend.prepare(weight), bias, None, activation, keep=True)
            assert ((z.double() - z_exact).abs() <= scale * 8 * (k + 4) * u).all(), (m, k, n, activation)
            interleaved = interleave(z.T).T if activation == "swiglu" else z
            assert torch.allclose(h, activate(interleaved, activation), rtol=1e-6, atol=1e-6)
    # too few rows for the kernel (fused gives None): the steps one by one, in the input's shape
    backend.fused = lambda *a, **kw: None
    x3 = torch.randn(4, 5, 48, generator=g)
    with torch.no_grad():
        y = _epilogues.linear(layer, x3, torch.randn(4, 5, 64, generator=g), "silu", norm)
    assert y.shape == (4, 5, 64)
    print("interpreter epilogues ok")
    """
)


def test_fused_epilogues_in_the_triton_interpreter():
    interpret(INTERPRETED, "interpreter epilogues ok")


TABLE = textwrap.dedent(
    """
    import copy
    import torch
    import ase_tcfp32.layers
    from ase_tcfp32 import _epilogues
    from ase_tcfp32._kernels.triton_gemm import TritonBackend
    from ase_tcfp32._attention import swap_attention_blocks
    from ase_tcfp32._table import swap_backends, swap_transformer_layers
    from ase_tcfp32.layers import swap_linear_layers
    from ase_tcfp32.testing import random_pet

    backend = TritonBackend("tf32x3")
    _epilogues.get_backend = ase_tcfp32.layers.get_backend = lambda precision, device, emulate: backend
    calls = []
    fused = backend.fused
    backend.fused = lambda *a, **kw: calls.append(a[3:]) or fused(*a, **kw)
    u = 2.0**-24
    g = torch.Generator().manual_seed(0)

    # a PET-MAD-shaped PreLN layer (RMSNorm, SwiGLU, node features 4x wider than edges), frozen
    pet = random_pet("tiny", seed=3).requires_grad_(False)
    exact_backend = copy.deepcopy(pet.backend).double()  # metatrain's, in FP64
    exact = exact_backend.gnn_layers[0].trans.layers[0]
    swap_linear_layers(pet, "tf32x3")
    assert swap_attention_blocks(pet)  # ours takes the layer's norm
    plain = pet.backend.gnn_layers[0].trans.layers[0]
    ours = copy.deepcopy(plain)
    assert swap_transformer_layers(ours) == [""] and type(ours).__name__ == "FusedTransformerLayer"
    for norm in (ours.norm_attention, ours.norm_mlp, ours.norm_center_features):  # not all ones
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    plain.load_state_dict(ours.state_dict()), exact.load_state_dict(ours.state_dict())
    atoms, slots, d, d_node = 40, 7, plain.d_model, exact.center_contraction.in_features
    nodes, edges = torch.randn(atoms, 1, d_node, generator=g), torch.randn(atoms, slots, d, generator=g)
    factors = torch.rand(atoms, slots + 1, slots + 1, generator=g)
    grads = torch.randn(atoms, 1, d_node, generator=g), torch.randn(atoms, slots, d, generator=g)

    def run(layer, dtype, grad):
        inputs = [t.to(dtype).requires_grad_(grad) for t in (nodes, edges)]
        with torch.set_grad_enabled(grad):
            outputs = layer(*inputs, factors.to(dtype), False)
            if grad:
                torch.autograd.backward(outputs, [t.to(dtype) for t in grads])
        return [t.detach().double() for t in outputs] + ([t.grad.double() for t in inputs] if grad else [])

    for grad in (False, True):
        reference = run(exact, torch.float64, grad)
        before = len(calls)
        fused_values = run(ours, torch.float32, grad)
        # node expansion, both feed-forwards' two layers; the attention's normed projection without gradients
        assert len(calls) - before == (6 if not grad else 5), (grad, len(calls) - before)
        plain_values = run(plain, torch.float32, grad)
        for k, (f, p, r) in enumerate(zip(fused_values, plain_values, reference)):
            scale = r.abs().max()
            error, unfused = (f - r).abs().max(), (p - r).abs().max()
            assert error <= 2 * unfused + 16 * u * scale, (grad, k, float(error), float(unfused))
    # the heads (Linear, SiLU, Linear, SiLU) of the swapped backend: their SiLUs in the GEMMs
    plain_heads = type(pet.backend)._calculate_last_layer_features
    assert swap_backends(pet) == ["backend"]
    features = [torch.randn(atoms, d_node, generator=g)], [torch.randn(atoms, slots, d, generator=g)]
    with torch.no_grad():
        before = len(calls)
        lazy = pet.backend._calculate_last_layer_features(*features)
        assert len(calls) == before  # computed when read (HeadFeatures)
        fused_heads = [dict(heads) for heads in lazy]
        assert len(calls) - before == 2 * 2 * 3  # two layers of node and edge heads, three targets
        plain_values = plain_heads(pet.backend, *features)
        exact_values = plain_heads(exact_backend, *([t.double() for t in f] for f in features))
    for which in range(2):
        assert fused_heads[which].keys() == plain_values[which].keys() == exact_values[which].keys()
        for name in exact_values[which]:
            (f,), (p,), (r,) = fused_heads[which][name], plain_values[which][name], exact_values[which][name]
            error, unfused = (f.double() - r).abs().max(), (p.double() - r).abs().max()
            assert error <= 2 * unfused + 16 * u * r.abs().max(), (which, name, float(error), float(unfused))
    # PostLN layers keep metatrain's code
    plain.transformer_type = "PostLN"
    assert swap_transformer_layers(plain) == []
    print("interpreter table layers ok")
    """
)


def test_fused_transformer_layers_in_the_triton_interpreter():
    """metatrain's PreLN layer with its attention's norm, feed-forwards and node update in
    fused GEMMs, and the backend's heads with their SiLUs fused (ase_tcfp32._table):
    outputs and, with gradients, input gradients no further from FP64 than metatrain's
    own code in FP32; the fused kernels ran."""
    interpret(TABLE, "interpreter table layers ok")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3", "bf16x9"])
def test_fused_epilogues_on_the_gpu(precision):
    """On the GPU, each kernel's fused output against float64: no further from it than the
    unfused steps, and its SiLU within a few units of SiLU of its own unfused product."""
    from ase_tcfp32._backends import get_backend

    device = torch.device("cuda")
    backend = get_backend(precision, device)
    if not hasattr(backend, "fused"):
        pytest.skip(f"{precision}'s backend here does not fuse")
    g = torch.Generator(device=device).manual_seed(0)
    m, k, n = 20_000, 256, 512
    x = torch.randn(m, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) / 16
    b, r = torch.randn(n, generator=g, device=device), torch.randn(m, n, generator=g, device=device)
    gamma = torch.rand(k, generator=g, device=device) + 0.5
    rms = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    index = torch.randint(0, 7, (m,), generator=g, device=device)
    embedded = Embedding(
        torch.randn(7, n, generator=g, device=device), index, x[:, :4].contiguous(), w[:, :4].contiguous()
    )
    for activation, residual, eps in [
        ("silu", embedded, None),
        (None, r, None),
        ("silu", None, None),
        ("silu", r, None),
        ("swiglu", None, None),
        ("swiglu", None, 1e-6),
        (None, None, 1e-6),
    ]:
        weight, bias = (interleave(w), interleave(b)) if activation == "swiglu" else (w, b)
        normed = x.double() * rms if eps else x.double()  # the RMS norm's weight gamma folded into the layer's
        weight = (weight.double() * gamma.double()).float() if eps else weight
        z = normed @ weight.double().T + bias.double()
        prepared = backend.prepare(weight)
        y = backend.fused(x, prepared, bias, residual, activation, eps)
        steps = backend.forward((normed.float() if eps else x).contiguous(), prepared, bias)
        computed = isinstance(residual, Embedding)  # the kernel sums it in its own order
        residual = residual.tensor() if computed else residual
        plain = steps + (0.0 if residual is None else residual)
        exact = activate(z + (0.0 if residual is None else residual.double()), activation)
        steps = activate(plain, activation)  # what the unfused layers compute
        fused_error, steps_error = ((t.double() - exact).abs().max().item() for t in (y, steps))
        assert fused_error <= 1.5 * steps_error + 1e-6, (activation, eps, fused_error, steps_error)
        if activation == "silu" and not eps and not computed:  # the kernel's SiLU: a few units of SiLU of its product
            own = torch.nn.functional.silu(plain.double())
            assert ((y.double() - own).abs() <= 8 * U * own.abs() + 1e-30).all()
    # for a backward pass: the kept pre-activation ([v | g] for SwiGLU), against float64
    for activation in ("silu", "swiglu"):
        weight, bias = (interleave(w), interleave(b)) if activation == "swiglu" else (w, b)
        h, z = backend.fused(x, backend.prepare(weight), bias, None, activation, keep=True)
        exact = x.double() @ w.double().T + b.double()
        steps = backend.forward(x, backend.prepare(w), b)
        assert (z.double() - exact).abs().max() <= 1.5 * (steps.double() - exact).abs().max() + 1e-6
        interleaved = interleave(z.T).T if activation == "swiglu" else z
        assert torch.allclose(h, activate(interleaved, activation), rtol=8 * U, atol=1e-30)


def _double(layer: torch.nn.Linear) -> torch.nn.Linear:
    """A float64 ``nn.Linear`` with ``layer``'s weights."""
    double = torch.nn.Linear(layer.in_features, layer.out_features, device=layer.weight.device, dtype=torch.float64)
    with torch.no_grad():
        double.weight.copy_(layer.weight), double.bias.copy_(layer.bias)
    return double.requires_grad_(False)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3"])
def test_folded_compression_with_gradients_on_the_gpu(precision):
    """The compression's two layers with gradients (_epilogues.pair): the folded embeddings
    computed in the first kernel and their backward in one pass (SiLU's gradient and the
    geometry's, ase_tcfp32._kernels.folded). Output and input gradients no further from
    float64 than the steps one by one; the output the same bits as without gradients."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    m, d = 30_000, 256
    first = TCLinear(d, d, precision=precision).to(device).requires_grad_(False)
    second = TCLinear(d, d, precision=precision).to(device).requires_grad_(False)
    x = torch.randn(m, d, generator=g, device=device)
    table, index = torch.randn(5, d, generator=g, device=device), torch.randint(0, 5, (m,), generator=g, device=device)
    geometry, matrix = torch.randn(m, 4, generator=g, device=device) * 3, torch.randn(d, 4, generator=g, device=device)
    grad_y = torch.randn(m, d, generator=g, device=device)
    results = {}
    for run in ("fused", "unfused", "fp64"):
        dtype = torch.float64 if run == "fp64" else torch.float32
        layers = [_double(layer) if run == "fp64" else layer for layer in (first, second)]
        xg, gg = (t.to(dtype, copy=True).requires_grad_() for t in (x, geometry))
        inner = Embedding(table.to(dtype), index, gg, matrix.to(dtype))
        with _epilogues.unfused() if run != "fused" else contextlib.nullcontext():
            y = _epilogues.pair(*layers, xg, "silu", inner)
        y.backward(grad_y.to(dtype))
        results[run] = [t.detach().double() for t in (y, xg.grad, gg.grad)]
    for k, (fused, unfused, exact) in enumerate(zip(results["fused"], results["unfused"], results["fp64"])):
        errors = [(t - exact).abs().max().item() for t in (fused, unfused)]
        assert errors[0] <= 1.5 * errors[1] + 16 * U * exact.abs().max().item(), (k, errors)
    with torch.no_grad():
        plain = _epilogues.pair(first, second, x, "silu", Embedding(table, index, geometry, matrix))
    assert torch.equal(plain.double(), results["fused"][0])
    # the backward kernel alone against float64 (libdevice's exp on the GPU)
    from ase_tcfp32._kernels import folded

    z, dh = torch.randn(m, d, generator=g, device=device) * 6, torch.randn(m, d, generator=g, device=device)
    dz, dgeometry = folded.backward(dh, z, matrix)
    s = torch.sigmoid(z.double())
    exact = dh.double() * s * (1 + z.double() * (1 - s))
    assert ((dz.double() - exact).abs() <= 8 * U * dh.double().abs() * s * (1 + z.double().abs()) + 1e-30).all()
    bound = exact.abs() @ matrix.double().abs() * (d + 8) * U
    assert ((dgeometry.double() - exact @ matrix.double()).abs() <= bound).all()


@pytest.mark.gpu
def test_fused_silu_everywhere_on_the_gpu():
    """The kernels' SiLU over FP32's whole range, against SiLU of their own products (x
    times 1); below 1e-35 in size, where exp(-z) overflows FP32, torch's SiLU gives 0 too."""
    from ase_tcfp32._backends import get_backend

    device = torch.device("cuda")
    z = torch.cat([torch.linspace(-120, 120, 200_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.7, -88.7])])
    z = z.to(device)
    x = torch.nn.functional.pad(z[:, None], (0, 15))  # K = 16
    weight = torch.zeros(16, 16, device=device)
    weight[0, 0] = 1.0
    for precision in ("fp16x3", "tf32x3"):
        backend = get_backend(precision, device)
        y = backend.fused(x, backend.prepare(weight), None, None, "silu")[:, 0].double()
        plain = backend.forward(x, backend.prepare(weight), None)[:, 0].double()
        exact = torch.nn.functional.silu(plain)
        assert ((y - exact).abs() <= 8 * U * exact.abs() + 1e-35).all(), precision
    specials = torch.tensor([float("inf"), -float("inf"), float("nan")], device=device)
    with torch.no_grad():
        layer = TCLinear(16, 16, precision="fp16x3").to(device).requires_grad_(False)
        layer.weight.zero_()
        layer.weight[0, 0] = 1.0
        layer.bias.zero_()
        rows = torch.nn.functional.pad(specials[:, None], (0, 15)).repeat(7000, 1)
        y = _epilogues.linear(layer, rows, activation="silu")[:3, 0]
    expected = torch.nn.functional.silu(specials)
    assert np.array_equal(torch.isnan(y).cpu().numpy(), torch.isnan(expected).cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("precision, engine", [("fp16x3", "auto"), ("tf32x3", "auto"), ("fp16x3", "metatomic")])
def test_fused_pet_is_as_accurate_as_unfused_on_the_gpu(precision, engine):
    """PET-S shape, 1,536 water atoms: energies and direct forces and stress with the fused
    layers (no gradient asked) no further from float64 than the unfused layers'; and the
    conservative forces (fused residuals) too. On packed rows (``auto``) and on metatrain's
    neighbor table (``metatomic``: :mod:`ase_tcfp32._table`)."""
    import contextlib
    import copy

    from ase_tcfp32 import TCPETCalculator
    from ase_tcfp32.testing import random_pet
    from ase_tcfp32.validation import water_box

    pet = random_pet("s", seed=0)
    atoms = water_box(512, seed=0)
    wanted = ["energy", "energies", "non_conservative_forces", "non_conservative_stress"]
    results = {}
    for name, options in {"fp64": {"dtype": "float64"}, "fused": {}, "unfused": {}}.items():
        options = (options or {"precision": precision}) | {"engine": engine}
        with _epilogues.unfused() if name == "unfused" else contextlib.nullcontext():  # graphs recorded so
            calc = TCPETCalculator(copy.deepcopy(pet), device="cuda", progress=False, check_accuracy=0, **options)
            results[name] = calc.evaluate([atoms], wanted)[0] | calc.evaluate([atoms])[0]
        del calc
    exact = results["fp64"]
    for key in ("energy", "energies", "non_conservative_forces", "non_conservative_stress", "forces", "stress"):
        scale = np.abs(exact[key]).max()
        fused, unfused = (np.abs(np.asarray(results[k][key]) - exact[key]).max() for k in ("fused", "unfused"))
        assert fused <= 2 * unfused + 16 * U * scale, (key, fused, unfused)
