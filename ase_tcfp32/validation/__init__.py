"""Fidelity checks of the precision modes, after the reference study."""

from .systems import water_box

__all__ = ["water_box"]
