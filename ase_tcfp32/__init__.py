"""PET machine-learned potentials in ASE with FP32-accurate tensor-core GEMMs."""

from ._prepare import prepare_model
from ._version import __version__
from .calculator import TCPETCalculator
from .layers import TCLinear, restore_linear_layers, swap_linear_layers, tc_linear
from .models import ModelDownloadError, known_models, load_pet
from .precision import (
    PRECISIONS,
    EmulationWarning,
    UnsupportedPrecisionError,
    auto_precision,
    available_precisions,
)
from .watchdog import PrecisionWarning

__all__ = [
    "__version__",
    "PRECISIONS",
    "EmulationWarning",
    "ModelDownloadError",
    "PrecisionWarning",
    "TCLinear",
    "TCPETCalculator",
    "UnsupportedPrecisionError",
    "auto_precision",
    "available_precisions",
    "known_models",
    "load_pet",
    "prepare_model",
    "restore_linear_layers",
    "swap_linear_layers",
    "tc_linear",
]
