"""Engine-backed modules swapped into a diffusers pipeline, engine choice per call, stats.

The public entry for every face (the api layer's ``accelerate``, the WebUI adapter, a server):
:func:`engines_for` (the usable engines of a weights id and a component, as a
:class:`ComponentEngines` that picks one per call, with its fallback switch), :func:`refusal`
(why an engine cannot run here), and for pipelines :func:`swap_engines`, :func:`set_fallback`,
:func:`unswap` and :func:`stats`.
"""

from sd_accel.runtime.loader import engines_for, refusal, usable_handles
from sd_accel.runtime.selection import ComponentEngines, EngineHandle
from sd_accel.runtime.stats import ComponentStats
from sd_accel.runtime.swap import set_fallback, stats, swap_engines, unswap

__all__ = [
    "ComponentEngines",
    "ComponentStats",
    "EngineHandle",
    "engines_for",
    "refusal",
    "set_fallback",
    "stats",
    "swap_engines",
    "unswap",
    "usable_handles",
]
