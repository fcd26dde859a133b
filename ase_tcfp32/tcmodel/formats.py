"""Floating-point formats of tensor-core inputs and outputs, and rounding into them.

Values are carried as float64 numpy arrays; a value "in format f" is a float64 that
is exactly representable in f.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``fraction`` bits, normal exponents [emin, emax]."""

    name: str
    fraction: int
    emin: int
    emax: int
    finite_only: bool = False  # e4m3 has no Inf; its top pattern is NaN

    @property
    def max(self) -> float:
        top = 2.0 - 2.0**-self.fraction
        if self.finite_only:  # e4m3: the all-ones significand at emax is NaN
            top -= 2.0**-self.fraction
        return float(np.ldexp(top, self.emax))


FORMATS = {
    f.name: f
    for f in (
        Format("fp32", 23, -126, 127),
        Format("tf32", 10, -126, 127),
        Format("bf16", 7, -126, 127),
        Format("fp16", 10, -14, 15),
        Format("e4m3", 3, -6, 8, finite_only=True),
        Format("e5m2", 2, -14, 15),
    )
}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; valid: {', '.join(FORMATS)}") from None


def exponent(x: np.ndarray, emin: int) -> np.ndarray:
    """floor(log2|x|) clamped below at ``emin`` (int64); zeros give ``emin``."""
    _, e = np.frexp(x)
    return np.maximum(e.astype(np.int64) - 1, emin)


def round_to(x: np.ndarray, fmt: str | Format, mode: str = "rne", *, fraction: int | None = None) -> np.ndarray:
    """Round float64 ``x`` into ``fmt`` (subnormals kept), ``mode`` in rne, rz, rna.

    ``fraction`` overrides the format's fraction bits (the 13-bit fp8 accumulator).
    Overflow gives Inf (also under rz, as the tensor cores do), except that e4m3
    saturates to NaN. Inf and NaN pass through.
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    frac = fmt.fraction if fraction is None else fraction
    x = np.asarray(x, dtype=np.float64)
    quantum = np.ldexp(1.0, exponent(x, fmt.emin) - frac)
    scaled = x / quantum
    if mode == "rne":
        rounded = np.rint(scaled)
    elif mode == "rz":
        rounded = np.trunc(scaled)
    elif mode == "rna":
        rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
    else:
        raise ValueError(f"unknown rounding mode {mode!r}; valid: rne, rz, rna")
    out = rounded * quantum
    limit = np.ldexp(2.0, fmt.emax)  # the first power of two past the format
    if fmt.finite_only:
        out = np.where(np.abs(out) > fmt.max, np.nan, out)
    else:
        out = np.where(np.abs(out) >= limit, np.copysign(np.inf, x), out)
    out = np.where(np.isfinite(x), out, x)
    return out


def from_bits(words: np.ndarray) -> np.ndarray:
    """float64 values of fp32 bit patterns (uint32)."""
    return np.asarray(words, dtype=np.uint32).view(np.float32).astype(np.float64)


def to_bits(x: np.ndarray) -> np.ndarray:
    """fp32 bit patterns (uint32) of float64 values exact in fp32."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32)
