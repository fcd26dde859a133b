"""Bit-accurate numpy models of NVIDIA tensor-core arithmetic (V100 to B200).

>>> from ase_tcfp32.tcmodel import mma, matmul, round_to
>>> float(mma([1.0, 2.0**-24, 2.0**-24], [1.0, 1.0, 1.0], 0.0, gpu="A100", in_fmt="tf32")[()])
1.0
>>> float(mma([1.0, 2.0**-24, 2.0**-24], [1.0, 1.0, 1.0], 0.0, gpu="H100", in_fmt="tf32")[()])
1.0000001192092896

See ``docs/tcmodel.md`` for the model, the parameter table and its sources.
"""

from .core import matmul, mma
from .emulation import TCModelBackend, emulated_matmul
from .formats import FORMATS, round_to
from .presets import ALIASES, PRESETS, BlockParams, TensorCore, custom, tensor_core

__all__ = [
    "ALIASES",
    "FORMATS",
    "PRESETS",
    "BlockParams",
    "TCModelBackend",
    "TensorCore",
    "custom",
    "emulated_matmul",
    "matmul",
    "mma",
    "round_to",
    "tensor_core",
]
