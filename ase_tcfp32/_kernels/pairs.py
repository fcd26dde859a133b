"""The pairs of small periodic cells of one size, found on the GPU in a few launches (Triton).

:func:`count_pairs` and :func:`write_pairs` find, for B 3D-periodic structures of n atoms
each (a small water box, the beads of a path integral, rotated copies), every pair (i, j,
cell shift S) closer than the cutoff by comparing every atom with every other and with every
image of the cell up to a reach, as :func:`ase_tcfp32._neighbors.all_pairs` does in torch,
and write the neighbor list that the lean engine reads (sorted by center atom, each pair
with its reverse, padded) straight into its buffers. torch needs ~100 launches and 5 waits
for the device for that (3.3 ms for 192 water atoms on an H100, more than twice the
conservative evaluation's GPU work); here four launches and one wait (0.7 ms):

1. ``_wrap_kernel``: each atom's position wrapped into its cell, and the whole cells taken off;
2. ``_count_kernel``, one program per atom i: for every atom j how many images of j are
   within the cutoff, C[i, j], and its running sum over j, P[i, j] (exclusive);
3. the pairs before each atom's, ``first`` (a cumulative sum), whose last entry, the pair
   count, is the one number the host reads (at once for a new list, or later, with other
   results, for a list rebuilt in its buffers while the device is busy);
4. ``_write_kernel``, one program per atom i: recomputes the same comparisons and writes
   pair (i, j, image) at ``first[i] + P[i, j] +`` its rank among (i, j)'s images, and its
   reverse's index ``first[j] + P[j, i] + C[i, j] - 1 -`` that rank, where that index is
   within the buffers' capacity; more programs write the padding.

The reverse comes without a search: the vector of (j, i) with the mirror image (-S) is the
exact negative of that of (i, j, S) (the same operations on negated operands, whose
rounding is symmetric), so both pairs are found or neither, and (j, i)'s images come in the
mirror order. Both kernels call the same comparison (:func:`_close`), so they agree on
every pair.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .context import on_device

BLOCK_ATOMS = 32
"""Atoms j a program compares with its atom i at a time."""

BLOCK_IMAGES = 32
"""Cell images per step (27 for a reach of one cell each way)."""

BLOCK_PADDING = 1024
"""Padding pairs per program."""


@triton.jit
def _wrap_kernel(positions_ptr, geometry_ptr, wrapped_ptr, whole_ptr, N, n, BLOCK: tl.constexpr):
    """``wrapped = (x @ inverse - floor(x @ inverse)) @ cell`` and ``whole = floor(x @ inverse)``
    for each atom's position x [3] and its structure's cell and inverse (``geometry`` [B, 18])."""
    atoms = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = atoms < N
    g = geometry_ptr + (atoms // n) * 18
    x0 = tl.load(positions_ptr + atoms * 3, mask=inside, other=0.0)
    x1 = tl.load(positions_ptr + atoms * 3 + 1, mask=inside, other=0.0)
    x2 = tl.load(positions_ptr + atoms * 3 + 2, mask=inside, other=0.0)
    f0 = x0 * tl.load(g + 9, mask=inside) + x1 * tl.load(g + 12, mask=inside) + x2 * tl.load(g + 15, mask=inside)
    f1 = x0 * tl.load(g + 10, mask=inside) + x1 * tl.load(g + 13, mask=inside) + x2 * tl.load(g + 16, mask=inside)
    f2 = x0 * tl.load(g + 11, mask=inside) + x1 * tl.load(g + 14, mask=inside) + x2 * tl.load(g + 17, mask=inside)
    w0, w1, w2 = tl.floor(f0), tl.floor(f1), tl.floor(f2)
    f0, f1, f2 = f0 - w0, f1 - w1, f2 - w2
    for v in tl.static_range(3):
        value = f0 * tl.load(g + v, mask=inside) + f1 * tl.load(g + 3 + v, mask=inside)
        value += f2 * tl.load(g + 6 + v, mask=inside)
        tl.store(wrapped_ptr + atoms * 3 + v, value, mask=inside)
    tl.store(whole_ptr + atoms * 3, w0.to(tl.int64), mask=inside)
    tl.store(whole_ptr + atoms * 3 + 1, w1.to(tl.int64), mask=inside)
    tl.store(whole_ptr + atoms * 3 + 2, w2.to(tl.int64), mask=inside)


@triton.jit
def _image(geometry, images, v: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr):
    """Component v of the image vectors S @ cell [BLOCK_IMAGES] and the shifts S (3 x [BLOCK_IMAGES])
    of the image indices ``images`` (S runs over -R..R per cell vector, the last fastest)."""
    s0 = images // ((2 * R1 + 1) * (2 * R2 + 1)) - R0
    s1 = (images // (2 * R2 + 1)) % (2 * R1 + 1) - R1
    s2 = images % (2 * R2 + 1) - R2
    vector = s0.to(tl.float64) * tl.load(geometry + v) + s1.to(tl.float64) * tl.load(geometry + 3 + v)
    return vector + s2.to(tl.float64) * tl.load(geometry + 6 + v), s0, s1, s2


@triton.jit
def _close(
    wrapped_ptr, geometry, i, js, images, n, cutoff2,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, IMAGES: tl.constexpr,
):  # fmt: skip
    """[BLOCK_ATOMS, BLOCK_IMAGES]: whether atom j (of ``js``, in this structure) with the image
    (of ``images``) is within the cutoff of atom ``i`` (indices of the whole batch's atoms
    in ``i``, ``js``); not atom i itself, and nothing outside the structure or the images."""
    distance2 = tl.zeros([js.shape[0], images.shape[0]], tl.float64)
    for v in tl.static_range(3):
        image, _, _, _ = _image(geometry, images, v, R0, R1, R2)
        difference = tl.load(wrapped_ptr + js * 3 + v, mask=js < n, other=0.0) - tl.load(wrapped_ptr + i * 3 + v)
        vector = difference[:, None] + image[None, :]
        distance2 += vector * vector
    real = (js < n)[:, None] & (images < IMAGES)[None, :]
    itself = (js == i)[:, None] & (images == IMAGES // 2)[None, :]
    return (distance2 < cutoff2) & real & ~itself


@triton.jit
def _count_kernel(
    wrapped_ptr, geometry_ptr, counts_ptr, before_ptr, totals_ptr, n, cutoff2,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, IMAGES: tl.constexpr,
    BLOCK_ATOMS: tl.constexpr, BLOCK_IMAGES: tl.constexpr,
):  # fmt: skip
    """C[i, j], P[i, j] = sum of C[i, :j], and atom i's pairs, for this program's atom i."""
    atom = tl.program_id(0).to(tl.int64)
    structure = atom // n
    first_atom = structure * n
    geometry = geometry_ptr + structure * 18
    running = tl.zeros([], tl.int64)
    for start in range(0, n, BLOCK_ATOMS):
        local = start + tl.arange(0, BLOCK_ATOMS)
        js = first_atom + local
        count = tl.zeros([BLOCK_ATOMS], tl.int64)
        for image_start in range(0, IMAGES, BLOCK_IMAGES):
            images = image_start + tl.arange(0, BLOCK_IMAGES)
            close = _close(wrapped_ptr, geometry, atom, js, images, first_atom + n, cutoff2, R0, R1, R2, IMAGES)
            count += tl.sum(close.to(tl.int64), axis=1)
        row = atom * n + local
        tl.store(counts_ptr + row, count.to(tl.int32), mask=local < n)
        tl.store(before_ptr + row, (running + tl.cumsum(count, 0) - count).to(tl.int32), mask=local < n)
        running += tl.sum(count, 0)
    tl.store(totals_ptr + atom, running)


@triton.jit
def _write_kernel(
    wrapped_ptr, whole_ptr, geometry_ptr, counts_ptr, before_ptr, first_ptr, n, N, cutoff2, capacity,
    centers_ptr, neighbors_ptr, shifts_ptr, offsets_ptr, bins_ptr, reverse_ptr, valid_ptr,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, IMAGES: tl.constexpr,
    BLOCK_ATOMS: tl.constexpr, BLOCK_IMAGES: tl.constexpr, BLOCK_PADDING: tl.constexpr, BINS: tl.constexpr,
):  # fmt: skip
    """Programs 0 .. N - 1: atom i's pairs, each at its index (module doc); the others: the
    padding pairs from the pair count ``first[N]`` to ``capacity``."""
    program = tl.program_id(0).to(tl.int64)
    if program >= N:  # padding: atom 0 to itself, no shift, its own reverse, in structure 0's bins
        k = (program - N) * BLOCK_PADDING + tl.arange(0, BLOCK_PADDING)
        pad = (k >= tl.load(first_ptr + N)) & (k < capacity)
        zero = tl.zeros([BLOCK_PADDING], tl.int64)
        tl.store(centers_ptr + k, zero, mask=pad)
        tl.store(neighbors_ptr + k, zero, mask=pad)
        for v in tl.static_range(3):
            tl.store(shifts_ptr + k * 3 + v, zero, mask=pad)
            tl.store(offsets_ptr + k * 3 + v, zero.to(offsets_ptr.dtype.element_ty), mask=pad)
        tl.store(bins_ptr + k, k % BINS, mask=pad)
        tl.store(reverse_ptr + k, k, mask=pad)
        tl.store(valid_ptr + k, zero.to(tl.int1), mask=pad)
    else:
        atom = program
        structure = atom // n
        first_atom = structure * n
        geometry = geometry_ptr + structure * 18
        base = tl.load(first_ptr + atom)
        whole_i0 = tl.load(whole_ptr + atom * 3)
        whole_i1 = tl.load(whole_ptr + atom * 3 + 1)
        whole_i2 = tl.load(whole_ptr + atom * 3 + 2)
        for start in range(0, n, BLOCK_ATOMS):
            local = start + tl.arange(0, BLOCK_ATOMS)
            inside = local < n
            js = first_atom + local
            row = atom * n + local
            count = tl.load(counts_ptr + row, mask=inside, other=0).to(tl.int64)
            before = tl.load(before_ptr + row, mask=inside, other=0).to(tl.int64)
            before_reverse = tl.load(before_ptr + js * n + (atom - first_atom), mask=inside, other=0).to(tl.int64)
            first_j = tl.load(first_ptr + js, mask=inside, other=0)
            whole_j0 = tl.load(whole_ptr + js * 3, mask=inside, other=0)
            whole_j1 = tl.load(whole_ptr + js * 3 + 1, mask=inside, other=0)
            whole_j2 = tl.load(whole_ptr + js * 3 + 2, mask=inside, other=0)
            ranked = tl.zeros([BLOCK_ATOMS], tl.int64)  # (i, j)'s pairs in the earlier image blocks
            for image_start in range(0, IMAGES, BLOCK_IMAGES):
                images = image_start + tl.arange(0, BLOCK_IMAGES)
                close = _close(wrapped_ptr, geometry, atom, js, images, first_atom + n, cutoff2, R0, R1, R2, IMAGES)
                rank = ranked[:, None] + tl.cumsum(close.to(tl.int64), 1) - 1
                k = base + before[:, None] + rank
                stored = close & (k < capacity)  # more pairs than the buffers hold: the host drops the list
                tl.store(
                    reverse_ptr + k, first_j[:, None] + before_reverse[:, None] + count[:, None] - 1 - rank, mask=stored
                )
                tl.store(centers_ptr + k, atom + 0 * rank, mask=stored)
                tl.store(neighbors_ptr + k, js[:, None] + 0 * rank, mask=stored)
                tl.store(bins_ptr + k, structure * BINS + k % BINS, mask=stored)
                tl.store(valid_ptr + k, close, mask=stored)
                _, s0, s1, s2 = _image(geometry, images, 0, R0, R1, R2)
                shift0 = s0[None, :] + whole_i0 - whole_j0[:, None]
                shift1 = s1[None, :] + whole_i1 - whole_j1[:, None]
                shift2 = s2[None, :] + whole_i2 - whole_j2[:, None]
                tl.store(shifts_ptr + k * 3, shift0, mask=stored)
                tl.store(shifts_ptr + k * 3 + 1, shift1, mask=stored)
                tl.store(shifts_ptr + k * 3 + 2, shift2, mask=stored)
                for v in tl.static_range(3):
                    offset = shift0.to(tl.float64) * tl.load(geometry + v) + shift1.to(tl.float64) * tl.load(
                        geometry + 3 + v
                    )
                    offset += shift2.to(tl.float64) * tl.load(geometry + 6 + v)
                    tl.store(offsets_ptr + k * 3 + v, offset.to(offsets_ptr.dtype.element_ty), mask=stored)
                ranked += tl.sum(close.to(tl.int64), axis=1)


def geometry(cells: np.ndarray, device: torch.device) -> torch.Tensor:
    """The cells [B, 3, 3] (rows the cell vectors; on the host) and their inverses as the
    kernels read them, [B, 18] float64 on ``device``."""
    cells = np.asarray(cells, dtype=np.float64)
    flat = np.concatenate([cells.reshape(len(cells), 9), np.linalg.inv(cells).reshape(len(cells), 9)], 1)
    return torch.from_numpy(flat).to(device)


def count_pairs(positions: torch.Tensor, cells: torch.Tensor, cutoff: float, reach: list[int]) -> tuple:
    """Steps 1-3 (module doc) for B structures of n atoms (``positions`` [B, n, 3], float64,
    on CUDA or under Triton's interpreter; ``cells`` their :func:`geometry` on the same
    device), pairs closer than ``cutoff`` (Å) among images up to ``reach`` cells each way;
    queued, without waiting for the device.
    :return: ``first`` [B n + 1] (atom a's pairs are ``first[a] .. first[a + 1] - 1``; the
        last entry is the pair count) and the state that :func:`write_pairs` takes: the
        wrapped positions, whole cells, the geometry, C and P [B n, n] (int32: at most n x
        images each), ``first``, the cutoff squared, the reach and the count of images.
    """
    count, n = positions.shape[:2]
    device, atoms = positions.device, count * n
    positions = positions.reshape(atoms, 3).contiguous()
    wrapped, whole = torch.empty_like(positions), torch.empty(atoms, 3, dtype=torch.int64, device=device)
    counts, before = (torch.empty(atoms, n, dtype=torch.int32, device=device) for _ in range(2))
    totals = torch.empty(atoms, dtype=torch.int64, device=device)
    first = torch.zeros(atoms + 1, dtype=torch.int64, device=device)
    images = int(np.prod([2 * r + 1 for r in reach]))
    shape = (*reach, images, BLOCK_ATOMS, BLOCK_IMAGES)
    with on_device(device):
        _wrap_kernel[(triton.cdiv(atoms, 128),)](positions, cells, wrapped, whole, atoms, n, BLOCK=128)
        _count_kernel[(atoms,)](wrapped, cells, counts, before, totals, n, cutoff**2, *shape, num_warps=2)
    torch.cumsum(totals, 0, out=first[1:])
    return first, (wrapped, whole, cells, counts, before, first, n, cutoff**2, reach, images)


def write_pairs(state: tuple, into: tuple, bins: int) -> None:
    """Step 4 (module doc): the pairs counted by :func:`count_pairs` (its ``state``) written
    into ``into``: centers, neighbors [E] int64, shifts [E, 3] int64, offsets [E, 3]
    (S @ cell, Å, any float type), bins [E] int64 (pair k of structure b: ``b * bins + k %
    bins``), reverse [E] int64, valid [E] bool, the rest after the pair count padding
    (atom 0 to itself); ``first`` being :func:`count_pairs`' own. Where E is less than the
    pair count, only the pairs within it are written (and the list is incomplete)."""
    wrapped, whole, geometry, counts, before, first, n, cutoff2, reach, images = state
    capacity, atoms = into[0].shape[0], wrapped.shape[0]
    grid = (atoms + triton.cdiv(capacity, BLOCK_PADDING),)
    with on_device(wrapped.device):
        _write_kernel[grid](
            wrapped, whole, geometry, counts, before, first, n, atoms, cutoff2, capacity, *into,
            *reach, images, BLOCK_ATOMS, BLOCK_IMAGES, BLOCK_PADDING, bins, num_warps=2,
        )  # fmt: skip
