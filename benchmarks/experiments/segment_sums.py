"""Per-pair values summed onto their center atoms: ``index_add_`` against ``torch.segment_reduce``
and a one-program-per-atom Triton sum, at the sizes of the lean step (pairs sorted by center).

    python benchmarks/experiments/segment_sums.py [--out F.json]

First decided: ``segment_reduce`` (0.03-0.06 ms at 4.4 million pairs on the H200, against
0.17-0.18 ms for ``index_add_`` with no padding on any atom); the Triton sum was faster still
but a kernel to keep for ~0.03 ms per call. Since, small systems' CUDA graphs made torch's
kernels the slow part there, and the package runs a Triton sum
(``ase_tcfp32._kernels.segments``, design page: "Small systems"). Errors are against float64
sums, relative to the largest.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from ase_tcfp32.validation.common import environment


@triton.jit
def _segsum(x_ptr, first_ptr, out_ptr, C: tl.constexpr, CP: tl.constexpr, CHUNK: tl.constexpr):
    a = tl.program_id(0)
    start = tl.load(first_ptr + a)
    end = tl.load(first_ptr + a + 1)
    r = tl.arange(0, CHUNK)
    c = tl.arange(0, CP)
    acc = tl.zeros((CHUNK, CP), tl.float32)
    for s in range(start, end, CHUNK):
        rows = s + r
        acc += tl.load(x_ptr + rows[:, None] * C + c[None, :], mask=(rows < end)[:, None] & (c < C)[None, :], other=0.0)
    tl.store(out_ptr + a * C + c, tl.sum(acc, 0), mask=c < C)


def segsum(x, first):
    n = first.numel() - 1
    C = x.shape[1] if x.dim() == 2 else 1
    out = x.new_empty(n, *x.shape[1:])
    _segsum[(n,)](x, first, out, C=C, CP=max(2, triton.next_power_of_2(C)), CHUNK=128, num_warps=4)
    return out


def main(out: str | None) -> None:
    rows = []
    for n, per in ((17280, 255), (17280, 31), (192, 255)):
        counts = torch.randint(per - 20, per + 20, (n,), device="cuda")
        first = torch.zeros(n + 1, dtype=torch.long, device="cuda")
        first[1:] = counts.cumsum(0)
        e = int(first[-1])
        centers = torch.repeat_interleave(torch.arange(n, device="cuda"), counts)
        for C in (1, 3):
            x = torch.randn(e, C, device="cuda") if C > 1 else torch.randn(e, device="cuda")
            ia = do_bench(lambda: x.new_zeros(n, *x.shape[1:]).index_add_(0, centers, x), warmup=10, rep=100)
            sr = do_bench(lambda: torch.segment_reduce(x, "sum", offsets=first, axis=0), warmup=10, rep=100)
            ts = do_bench(lambda: segsum(x, first), warmup=10, rep=100)
            ref = x.double().new_zeros(n, *x.shape[1:]).index_add_(0, centers, x.double())
            err = [
                ((f - ref).abs().max() / ref.abs().max()).item()
                for f in (torch.segment_reduce(x, "sum", offsets=first, axis=0), segsum(x, first))
            ]
            r = dict(atoms=n, pairs=e, C=C, index_add_ms=ia, segment_reduce_ms=sr, triton_ms=ts, errors=err)
            print(json.dumps(r), flush=True)
            rows.append(r)
    if out:
        with open(out, "w") as f:
            json.dump({"environment": environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    main(parser.parse_args().out)
