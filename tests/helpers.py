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
