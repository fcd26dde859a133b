"""Tensor-core parameters per GPU generation (Khattak & Mikaitis' toolbox, MMA-Sim).

A block FMA of ``block`` products is aligned to its largest exponent with ``23 + extra``
fraction bits kept (``extra`` = n_eab, the extra alignment bits), truncated toward zero,
summed exactly, and rounded once to the output. ``e_zero`` is the smallest alignment
exponent (fp32 / fp16 output). Sources and the bits the published GPU data confirm are
in ``docs/tcmodel.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class BlockParams:
    """Parameters of one block FMA for one input format."""

    block: int  # products per block FMA (N_FMA)
    extra: int  # extra alignment bits n_eab: F = 23 + extra fraction bits kept
    e_zero_fp32: int  # minimum alignment exponent, fp32 output
    e_zero_fp16: int  # minimum alignment exponent, fp16 output
    out_fraction: int = 23  # fraction bits of the fp32 result (13 on the fp8 path of Ada/Hopper)
    final_rne: bool = False  # what-if: round the fp32 result to nearest instead of toward zero

    @property
    def fraction(self) -> int:
        return 23 + self.extra


@dataclass(frozen=True, eq=False)
class TensorCore:
    """A GPU generation's tensor core: block parameters per input format."""

    name: str
    formats: dict = field(default_factory=dict)

    def params(self, in_fmt: str) -> BlockParams:
        try:
            return self.formats[in_fmt]
        except KeyError:
            raise ValueError(
                f"{self.name} tensor cores take no {in_fmt!r} inputs; they take {', '.join(self.formats)}"
            ) from None


def _ampere_like(name: str, fp8: bool = False) -> TensorCore:
    formats = {
        "fp16": BlockParams(8, 1, -132, -20),
        "bf16": BlockParams(8, 1, -132, -20),
        "tf32": BlockParams(4, 1, -132, -20),
    }
    if fp8:
        formats.update(
            e4m3=BlockParams(16, -10, -132, -20, out_fraction=13), e5m2=BlockParams(16, -10, -132, -20, out_fraction=13)
        )
    return TensorCore(name, formats)


def _hopper_like(name: str, fp8_fraction: int) -> TensorCore:
    fp8 = BlockParams(32, fp8_fraction - 23, -133, -21, out_fraction=min(23, fp8_fraction))
    formats = {
        "fp16": BlockParams(16, 2, -133, -21),
        "bf16": BlockParams(16, 2, -133, -21),
        "tf32": BlockParams(8, 2, -133, -21),
        "e4m3": fp8,
        "e5m2": fp8,
    }
    return TensorCore(name, formats)


PRESETS = {
    "V100": TensorCore("V100", {"fp16": BlockParams(4, 0, -131, -19)}),
    "A100": _ampere_like("A100"),
    "Ada": _ampere_like("Ada", fp8=True),
    "H100": _hopper_like("H100", fp8_fraction=13),
    "B200": _hopper_like("B200", fp8_fraction=25),
}
ALIASES = {
    "A2": "A100",
    "A30": "A100",
    "A40": "Ada",
    "L40S": "Ada",
    "RTX1000": "Ada",
    "H200": "H100",
    "RTXPRO6000": "B200",
}


def tensor_core(gpu: str | TensorCore) -> TensorCore:
    """A preset by name (aliases such as ``"H200"`` allowed) or a user-defined TensorCore."""
    if isinstance(gpu, TensorCore):
        return gpu
    name = ALIASES.get(gpu, gpu)
    if name not in PRESETS:
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join([*PRESETS, *ALIASES])}, or pass a TensorCore")
    return PRESETS[name]


def custom(name: str, base: str | TensorCore, **changes) -> TensorCore:
    """A preset with some block parameters changed for every format, e.g.
    ``custom("B200-RN", "B200", final_rne=True)`` or ``custom("X", "A100", block=16)``."""
    base = tensor_core(base)
    return TensorCore(name, {f: replace(p, **changes) for f, p in base.formats.items()})
