"""Reference arithmetic for the tests that does not depend on the machine's BLAS."""

import numpy as np
import torch


def beads_of(atoms, count: int, seed: int = 0) -> list:
    """``count`` copies of ``atoms``, each displaced differently by 0.05 Å (like the beads
    of a path integral)."""
    rng = np.random.default_rng(seed)
    copies = []
    for _ in range(count):
        copy = atoms.copy()
        copy.positions += rng.normal(scale=0.05, size=copy.positions.shape)
        copies.append(copy)
    return copies


def rel_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """Normwise relative error of ``y`` against ``exact`` (usually FP64)."""
    return ((y.double() - exact).norm() / exact.norm()).item()


def fp32_in_order(x, w):
    """``x [M, K] @ w [N, K]^T`` in IEEE FP32 with every product and every addition
    rounded, summed in the order k = 0, 1, ..., K-1: the textbook FP32 dot product, the
    same bits on every machine (a BLAS blocks, vectorises and fuses its sums differently
    by CPU model, so its error is no fixed yardstick). numpy or torch in, same type out."""
    if isinstance(x, np.ndarray):
        acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
        for k in range(x.shape[1]):
            acc = acc + np.multiply.outer(x[:, k], w[:, k]).astype(np.float32)
        return acc
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = acc + torch.outer(x[:, k], w[:, k])
    return acc


def check_combination(device: str) -> None:
    """``ase_tcfp32._fused.combine_messages`` on ``device`` against FP64 on random
    involutions (pairs of slots swapped, the rest, like padding, their own reverse): the
    norm to a few roundings of its 2D-term sums, the gradient to those of two rows' LayerNorm
    gradients (its own row's first half, its reverse's second half)."""
    import math

    from ase_tcfp32._fused import combine_messages

    g = torch.Generator(device=device).manual_seed(0)
    u = 2.0**-24
    # widths below, at and past a power of two (PET-M's 384); rows filling no program, several
    for atoms, slots, width in [(1, 1, 16), (5, 7, 24), (9, 6, 32), (3, 4, 1), (11, 5, 384)]:
        n = atoms * slots
        order = torch.randperm(n, generator=g, device=device)
        reverse = torch.arange(n, device=device)
        half = (n // 3) * 2
        reverse[order[:half:2]], reverse[order[1:half:2]] = order[1:half:2], order[:half:2]
        reverse = reverse.reshape(atoms, slots)
        norm = torch.nn.LayerNorm(2 * width, device=device).requires_grad_(False)
        norm.weight.copy_(torch.randn(2 * width, generator=g, device=device))
        norm.bias.copy_(torch.randn(2 * width, generator=g, device=device))
        o = (torch.randn(atoms, slots, width, generator=g, device=device) * 3 + 1).requires_grad_()
        grad = torch.randn(atoms, slots, 2 * width, generator=g, device=device)
        y = combine_messages(o, reverse, norm)
        (do,) = torch.autograd.grad(y, o, grad)
        o64 = o.detach().double().requires_grad_()
        x = torch.cat([o64, o64.reshape(-1, width)[reverse.reshape(-1)].reshape(o64.shape)], -1)
        exact = torch.nn.functional.layer_norm(x, (2 * width,), norm.weight.double(), norm.bias.double(), norm.eps)
        (do64,) = torch.autograd.grad(exact, o64, grad.double())
        # sums of 2D terms (tree-reduced: log2(2D) roundings deep), a square root, a division
        depth = math.log2(2 * width) + 8
        xhat = (exact - norm.bias.double()) / norm.weight.double()
        scale = (xhat.abs() + 1) * norm.weight.double().abs() + norm.bias.double().abs()
        assert ((y.double() - exact).abs() <= 2 * depth * u * scale).all(), (atoms, slots, width)
        # dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, per row; o's gradient
        # is the sum of two rows' halves (its own row and its reverse's)
        rstd = 1 / torch.sqrt(x.detach().var(-1, unbiased=False) + norm.eps)
        gw = (grad.double() * norm.weight.double()).abs()
        size = rstd * (gw.amax(-1) + gw.mean(-1) + xhat.abs().amax(-1) * (gw * xhat.abs()).mean(-1))
        size = size + size.reshape(-1)[reverse.reshape(-1)].reshape(size.shape)
        assert ((do.double() - do64).abs() <= 2 * depth * u * size[..., None]).all(), (atoms, slots, width)
        # with the layer's input edges: their sum with o too (one FP32 addition, as torch's),
        # and its gradient joins o's (two more roundings, of sums bounded by size + |ds|:
        # size bounds each row's LayerNorm gradient too)
        edges = torch.randn(atoms, slots, width, generator=g, device=device).requires_grad_()
        grad_s = torch.randn(atoms, slots, width, generator=g, device=device)
        y2, summed = combine_messages(o, reverse, norm, residual=edges)
        assert torch.equal(y2, y) and torch.equal(summed, edges.detach() + o.detach())
        do2, dedges = torch.autograd.grad((y2, summed), (o, edges), (grad, grad_s))
        assert torch.equal(dedges, grad_s)
        within = 2 * depth * u * size[..., None] + 2 * u * (size[..., None] + grad_s.double().abs())
        assert ((do2.double() - (do64 + grad_s.double())).abs() <= within).all(), (atoms, slots, width)


def check_pre_norm(device: str) -> None:
    """``ase_tcfp32._fused.pre_norm`` on ``device`` against FP64: the normed rows to a few
    roundings of their d-term sums of squares, the gradient of x (through the norm and the
    residual together, through either alone) to those of the norm's gradient."""
    import math

    from ase_tcfp32._fused import pre_norm

    g = torch.Generator(device=device).manual_seed(0)
    u = 2.0**-24
    for rows, width, eps in [(1, 16, None), (37, 24, 1e-5), (130, 256, 1e-6), (5, 1024, None), (3, 384, 1e-5)]:
        norm = torch.nn.RMSNorm(width, eps=eps, device=device).requires_grad_(False)
        norm.weight.copy_(torch.randn(width, generator=g, device=device))
        x = (torch.randn(rows, width, generator=g, device=device) * 3 + 1).requires_grad_()
        grad_r, grad_y = (torch.randn(rows, width, generator=g, device=device) for _ in range(2))
        residual, tokens, left = pre_norm(x, norm)
        assert left is None and torch.equal(residual, x)
        x64 = x.detach().double().requires_grad_()
        e = torch.finfo(torch.float32).eps if eps is None else eps
        exact = torch.nn.functional.rms_norm(x64, (width,), norm.weight.double(), e)
        depth = math.log2(width) + 8
        rstd = 1 / torch.sqrt((x64.detach() ** 2).mean(-1, keepdim=True) + e)
        assert ((tokens.double() - exact).abs() <= depth * u * (exact.abs() + rstd * x64.detach().abs())).all()
        gw = (grad_y.double() * norm.weight.double()).abs()
        size = rstd * gw + x64.detach().abs() * rstd**3 * (gw * x64.detach().abs()).mean(-1, keepdim=True)
        for weights in [(1, 1), (0, 1), (1, 0)]:
            used = [t * w for t, w in zip((residual, tokens), weights) if w]
            grads = [grad for grad, w in zip((grad_r, grad_y), weights) if w]
            (dx,) = torch.autograd.grad(used, x, grads, retain_graph=True)
            expected = (grad_r.double() if weights[0] else 0) + (
                torch.autograd.grad(exact, x64, grad_y.double(), retain_graph=True)[0] if weights[1] else 0
            )
            bound = depth * u * (size * weights[1] + grad_r.double().abs() * weights[0])
            assert ((dx.double() - expected).abs() <= bound).all(), (rows, width, weights)
    x = torch.randn(4, 16, device=device)
    layer = torch.nn.LayerNorm(16, device=device).requires_grad_(False)
    for tensor, norm in [(x, torch.nn.RMSNorm(16, device=device)), (x.requires_grad_(), layer)]:
        residual, tokens, left = pre_norm(tensor, norm)  # no gradient asked, or not an RMS norm: the layer's to apply
        assert residual is tensor and tokens is tensor and left is norm


def check_narrow(device: str) -> None:
    """The narrow-product kernel (PET's heads' last layers: 1, 3 or 9 outputs) against
    float64 within FP32's summation bound, with and without a bias, on partial row blocks
    and a strided input, in each of its launch configurations (the largest on a GPU only:
    too many programs for the interpreter); fewer than 8 terms and more than 16 outputs
    left to torch."""
    from ase_tcfp32._kernels import narrow

    g = torch.Generator(device).manual_seed(5)
    u = 2.0**-24
    shapes = [(700, 256, 1), (700, 256, 3), (193, 384, 9), (5, 16, 16), (1000, 8, 2), (2100, 64, 9)]
    shapes += [(70001, 256, 3)] if device == "cuda" else []
    assert len({narrow.launch_config(m) for m, _, _ in shapes}) == len(narrow.LAUNCHES) - (device != "cuda")
    for m, k, n in shapes:
        x = torch.randn(m, k + 3, device=device, generator=g)[:, 3:]  # rows of stride k + 3
        w, b = torch.randn(n, k, device=device, generator=g), torch.randn(n, device=device, generator=g)
        for bias in (None, b):
            y = narrow.linear(x, w, bias)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
            assert y.shape == (m, n) and ((y.double() - exact).abs() <= (k + 2) * u * scale).all(), (m, k, n)
    x = torch.randn(50, 7, device=device, generator=g)
    assert not narrow.usable(x, torch.randn(3, 7, device=device)) and not narrow.usable(
        x, torch.randn(17, 7, device=device)
    )
    assert narrow.usable(torch.randn(50, 8, device=device), torch.randn(16, 8, device=device))


def quiet_calculator(pet, **options):
    """A CPU FP32 ``TCPETCalculator`` on a copy of ``pet`` (its notes silenced), ``options``
    overriding those defaults."""
    import copy
    import warnings

    from ase_tcfp32 import TCPETCalculator

    options = {"precision": "fp32", "device": "cpu", "progress": False, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TCPETCalculator(copy.deepcopy(pet), **options)


def assert_as_accurate_as_fp32(atoms, methods, exact, fp32, calc) -> None:
    """Each calculator method of ``methods`` (e.g. ``"get_forces_ensemble"``) on ``atoms``
    from ``calc`` no further from the float64 calculator ``exact``'s than 4 times the FP32
    calculator ``fp32``'s distance (plus 1e-9: both can be exact)."""
    reference = {method: getattr(exact, method)(atoms) for method in methods}
    errors = {
        name: {method: np.abs(getattr(c, method)(atoms) - reference[method]).max() for method in methods}
        for name, c in (("fp32", fp32), ("calc", calc))
    }
    for method in methods:
        assert errors["calc"][method] <= 4 * errors["fp32"][method] + 1e-9, (method, errors)
