"""The packed attention kernels alone, per number of head groups (``groups`` of
``forward_packed`` / ``backward_packed``), on water's sequences, replayed in a CUDA graph
(Triton's ``do_bench_cudagraph``): µs per call, forward / backward, and the package's default.

    python benchmarks/experiments/attention_groups.py [--models m,s] [--atoms 192,576,2304,17280]

Decided (design page, "Small systems"): the fewest groups that give every multiprocessor
two programs, and one head per program for PET-M's padded heads in the backward.
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1]))
from attention import D_PET, HEADS, MARGIN, water_counts  # noqa: E402

from ase_tcfp32._kernels import attention as kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="m,s")
    parser.add_argument("--atoms", default="192,576,2304,17280")
    args = parser.parse_args()
    for size in args.models.split(","):
        for atoms in map(int, args.atoms.split(",")):
            counts, width = water_counts(size, atoms), D_PET[size]
            tokens, scale = int(counts.max()) + 1 + MARGIN, 1 / (width // HEADS) ** 0.5
            first, total = torch.cumsum(counts, 0) - counts, int(counts.sum())
            qkv = torch.randn(total, 3 * width, device="cuda")
            node_qkv = torch.randn(atoms, 3 * width, device="cuda")
            bias = torch.log(torch.clamp(torch.rand(total, device="cuda") ** 2, 1e-15))
            sequences = kernels.Sequences(first, counts, counts.sum(), tokens)
            blocks = kernels.packed_blocks(sequences, HEADS, width // HEADS)
            grads = torch.randn(total, width, device="cuda"), torch.randn(atoms, width, device="cuda")
            line = []
            for groups in (1, 2, 4, 8, None):

                def forward(groups=groups):
                    kernels.forward_packed(qkv, node_qkv, bias, sequences, HEADS, scale, blocks=blocks, groups=groups)

                def backward(groups=groups):
                    kernels.backward_packed(
                        *grads, qkv, node_qkv, bias, sequences, HEADS, scale, blocks=blocks, groups=groups
                    )

                us = [1000 * do_bench_cudagraph(f, rep=100) for f in (forward, backward)]
                line.append(f"{'default' if groups is None else f'G{groups}'} {us[0]:.0f}/{us[1]:.0f}")
            print(size, atoms, "µs forward/backward:", "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
