"""The segment sums of sorted per-pair rows (:mod:`ase_tcfp32._kernels.segments`) against
float64 sums, their gradient, and their two users (the pairs' gradients onto the atoms,
:class:`ase_tcfp32._neighbors.PairTerms`, and the adaptive cutoffs' neighbor counts): on
CPU through Triton's interpreter, and on the GPU (``gpu``-marked)."""

import os
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from test_triton_interpreter import interpret  # noqa: E402

LENGTHS = [0, 1, 0, 2, 300, 1, 37, 256, 257, 0, 5, 129, 3, 0]
"""Segment lengths: empty ones (first and last too), single rows, chunk-sized and ragged ones."""


def segments(lengths: list[int], device: str) -> torch.Tensor:
    """``first`` [N + 1] int64 of segments of ``lengths`` rows one after another."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(device)


def check_segment_sums(device: str) -> None:
    """:func:`segment_sum` on ``device`` (CUDA, or CPU under the interpreter) against float64
    sums, to the rounding of sums of as many terms; its gradient; the same bits twice."""
    from ase_tcfp32._kernels.segments import on_kernel, segment_sum

    g = torch.Generator().manual_seed(0)
    lengths = LENGTHS + torch.randint(0, 400, (6,), generator=g).tolist()
    first = segments(lengths, device)
    rows, padding = sum(lengths), 11
    atom = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [rows] each row's segment
    for shape in [(), (3,), (70,), (2, 3)]:  # 70 columns: two programs per segment
        for dtype, u in [(torch.float32, 2.0**-24), (torch.float64, 2.0**-53)]:
            values = torch.randn(rows + padding, *shape, dtype=torch.float64, generator=g)
            values[rows:] = 1e3  # the padding: left out
            values = values.to(device, dtype)
            assert on_kernel(values)
            sums = segment_sum(values, first)
            assert sums.shape == (len(lengths), *shape) and sums.dtype == dtype
            assert torch.equal(sums, segment_sum(values, first))  # deterministic
            exact = torch.stack([part.sum(0) for part in values.cpu().double()[:rows].split(lengths)])
            magnitude = torch.stack([part.abs().sum(0) for part in values.cpu().double()[:rows].split(lengths)])
            bound = 2 * max(lengths) * u * magnitude
            error = (sums.cpu().double() - exact).abs()
            assert (error <= bound).all(), (shape, dtype, (error - bound).max())
            assert not sums[torch.tensor(lengths, device=device) == 0].any()  # empty segments: exactly zero

            # the gradient: each row gets its segment's, the padding none
            leaf = values.clone().requires_grad_()
            weights = torch.randn(len(lengths), *shape, dtype=dtype, generator=g).to(device)
            (grad,) = torch.autograd.grad((segment_sum(leaf, first) * weights).sum(), leaf)
            assert torch.equal(grad[:rows].cpu(), weights.cpu()[atom]) and not grad[rows:].any()

    # gradcheck in float64 (few rows: the numerical Jacobian evaluates once per element)
    lengths = [0, 1, 3, 0, 4]
    first = segments(lengths, device)
    values = torch.randn(sum(lengths) + 2, 2, dtype=torch.float64, generator=g).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: segment_sum(v, first), (values,))
    assert torch.autograd.gradcheck(lambda v: segment_sum(v, first), (values[:, 0],))

    # no rows, no segments
    none = torch.zeros(4, dtype=torch.int64, device=device)
    assert torch.equal(segment_sum(torch.ones(0, 3, device=device), none), torch.zeros(3, 3, device=device))
    assert segment_sum(torch.ones(5, 3, device=device), none[:1]).shape == (0, 3)


INTERPRETED = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {os.path.dirname(__file__)!r})
    import torch
    from test_segments import check_segment_sums
    from ase_tcfp32._kernels import segments

    check_segment_sums("cpu")

    # PairTerms' backward (the pairs' gradients onto their atoms) in the kernel: test_lean's test
    calls = []
    kernel = segments.sum_rows
    segments.sum_rows = lambda values, first: calls.append(values.shape) or kernel(values, first)
    import ase.build
    from test_lean import test_pair_terms_backward_sums_each_atoms_pairs_and_their_reverses as pair_terms
    from ase_tcfp32.validation import water_box

    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.center(vacuum=3.0)
    ethanol.rattle(0.05, seed=3)
    pt_bulk = ase.build.bulk("Pt", "fcc", a=3.92, cubic=True)
    pt_bulk.rattle(0.05, seed=2)
    pair_terms(water_box(8, seed=1), pt_bulk, ethanol)
    assert len(calls) == 2 and calls[0][1:] == (3,) and calls[1][1:] == (), calls
    print("interpreter segment sums ok")
    """
)


def test_segment_sums_in_the_triton_interpreter():
    """Segments of 0 to ~400 rows with a padding tail, 1-D to 3-D values, float32 and float64,
    against float64 sums; gradients (gradcheck); PairTerms' backward through the kernel."""
    interpret(INTERPRETED, "interpreter segment sums ok")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="CPU tensors go to the interpreted kernel")
def test_segment_sums_outside_the_kernel_are_torchs():
    """Without the interpreter, CPU tensors (and dtypes the kernel does not take) go to
    ``torch.segment_reduce``: the same values and gradients, bit for bit."""
    from ase_tcfp32._kernels.segments import on_kernel, segment_sum
    from ase_tcfp32._neighbors import segment_sum as pair_sums

    first = segments([2, 0, 3], "cpu")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        values = torch.randn(7, 3).to(dtype).requires_grad_()
        assert not on_kernel(values)
        expected = torch.segment_reduce(values, "sum", offsets=first, axis=0)
        for function in (segment_sum, pair_sums):
            assert torch.equal(function(values, first), expected)
        (grad,) = torch.autograd.grad(segment_sum(values, first).sum(), values)
        assert torch.equal(grad, torch.autograd.grad(expected.sum(), values)[0])


# --- on the GPU (pytest -m gpu tests; skipped without CUDA) ---


@pytest.mark.gpu
def test_segment_sums_on_the_gpu():
    """The checks above on CUDA, then a CUDA graph of a sum and its gradient replayed on new
    values and weights (no host reads): the eager results, bit for bit."""
    from ase_tcfp32._kernels.segments import segment_sum

    check_segment_sums("cuda")

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 300, (2000,), generator=g).tolist()
    first = segments(lengths, "cuda")
    values = torch.randn(sum(lengths) + 100, 3, generator=g).cuda().requires_grad_()
    weights = torch.randn(len(lengths), 3, generator=g).cuda()

    def gradient(x):  # of a fresh leaf: no AccumulateGrad node of ``values`` made outside the capture's stream
        return torch.autograd.grad((segment_sum(x, first) * weights).sum(), x)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gradient(values.detach().clone().requires_grad_())  # compiles the kernels before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sums = segment_sum(values, first)
        (grad,) = torch.autograd.grad((sums * weights).sum(), values)
    with torch.no_grad():
        values.copy_(torch.randn(values.shape, generator=g).cuda())
        weights.copy_(torch.randn(weights.shape, generator=g).cuda())
    graph.replay()
    assert torch.equal(sums, segment_sum(values.detach(), first))
    assert torch.equal(grad, gradient(values.detach().clone().requires_grad_()))
