"""The block fused multiply-add of NVIDIA tensor cores, bit for bit, in numpy.

One block FMA ``d = c + sum_l a_l b_l`` over ``block`` products (Khattak & Mikaitis;
Xie et al., MMA-Sim; the algorithm both converged on):

1. products are exact and not renormalised: the alignment exponent of ``a_l b_l`` is
   ``e(a_l) + e(b_l)``, with ``e(x) = max(floor(log2|x|), emin of the input format)``;
2. ``e_max`` is the largest alignment exponent among the non-zero products, ``c`` (if
   non-zero, with fp32's emin) and the GPU's floor ``e_zero``;
3. every term, ``c`` included, keeps ``F = 23 + extra`` fraction bits below ``e_max``,
   truncated toward zero in sign-magnitude;
4. the truncated terms are summed exactly;
5. the sum is normalised and rounded once: toward zero to fp32 (23 fraction bits, or 13 on
   the fp8 path of Ada/Hopper; to nearest under the ``final_rne`` what-if), or to nearest
   even to fp16. Overflow gives Inf, an exact zero gives +0, and Inf/NaN inputs follow
   IEEE (NaN for Inf*0 or Inf-Inf).

float64 holds every step exactly: inputs have <= 11 significant bits, aligned terms are
integers below 2^28 and block sums below 2^34.
"""

from __future__ import annotations

import numpy as np

from .formats import exponent, get_format, round_to
from .presets import BlockParams

_DROPPED = -(10**6)  # alignment exponent of a zero product: never the maximum


def block_fma(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, params: BlockParams, in_fmt: str, out_fmt: str = "fp32"
) -> np.ndarray:
    """One block FMA per case: ``a``, ``b`` [L, *S] (products along axis 0), ``c`` [*S].

    ``a`` and ``b`` may be broadcastable to [L, *S] (an outer product: [L, M, 1] and
    [L, 1, N]). Inputs are float64 values exact in ``in_fmt`` (``c`` exact in
    ``out_fmt``); L may be shorter than the block (missing products are zeros).
    Returns float64 [*S].
    """
    fmt = get_format(in_fmt)
    a_ok, b_ok, c_ok = np.isfinite(a), np.isfinite(b), np.isfinite(c)
    specials = not (a_ok.all() and b_ok.all() and c_ok.all())
    a_f = np.where(a_ok, a, 0.0) if specials else a
    b_f = np.where(b_ok, b, 0.0) if specials else b
    c_f = np.where(c_ok, c, 0.0) if specials else c

    products = a_f * b_f
    e_prod = exponent(a_f, fmt.emin) + exponent(b_f, fmt.emin)
    e_prod = np.where(products != 0, e_prod, _DROPPED)
    e_c = np.where(c_f != 0, exponent(c_f, -126), _DROPPED)
    e_zero = params.e_zero_fp16 if out_fmt == "fp16" else params.e_zero_fp32
    e_max = np.maximum(np.maximum(e_prod.max(axis=0), e_c), e_zero)

    scale = np.ldexp(1.0, params.fraction - e_max)
    products *= scale
    total = np.trunc(products, out=products).sum(axis=0)
    total += np.trunc(c_f * scale)
    value = total * np.ldexp(1.0, e_max - params.fraction)
    d = _round_output(value, params, out_fmt)

    if specials:  # Inf/NaN inputs: IEEE float64 arithmetic gives the Inf or NaN
        special = ~((a_ok & b_ok).all(axis=0) & c_ok)
        with np.errstate(invalid="ignore"):
            ieee = c + (a * b).sum(axis=0)
        d = np.where(special, ieee, d)
    return d


def _round_output(value: np.ndarray, params: BlockParams, out_fmt: str) -> np.ndarray:
    if out_fmt == "fp16":
        d = round_to(value, "fp16", "rne")
    elif out_fmt == "fp32":
        d = round_to(value, "fp32", "rne" if params.final_rne else "rz", fraction=params.out_fraction)
    else:
        raise ValueError(f"unknown output format {out_fmt!r}; valid: fp32, fp16")
    return np.where(value == 0, 0.0, d)  # an exact zero is +0


def check_exact(x: np.ndarray, fmt: str, what: str) -> np.ndarray:
    """``x`` as float64, after checking that every finite value is exact in ``fmt``."""
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    if not np.array_equal(round_to(x[finite], fmt, "rne"), x[finite]):
        raise ValueError(f"{what} has values not exactly representable in {fmt}; round them first (round_to)")
    return x
