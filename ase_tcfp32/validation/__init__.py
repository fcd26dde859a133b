"""Fidelity checks of the precision modes, after the reference study.

Each test runs a model in several precisions, writes ``<test>.json`` and ``<test>.png``
to an output folder and returns its results as a dict (see ``docs/validation.md``).
"""

from .systems import cantor_slab, co_on_pt111, water_box

__all__ = ["cantor_slab", "co_on_pt111", "water_box"]
