"""Engine-backed modules swapped into a diffusers pipeline, engine choice per call, stats.

The public entry for every face (the api layer's ``accelerate``, the WebUI adapter, a server):
:func:`engines_for` (the usable engines of a weights id and a component, as a
:class:`ComponentEngines` that picks one per call, with its fallback switch), :func:`refusal`
(why an engine cannot run here), and for pipelines :func:`swap_engines`, :func:`set_fallback`,
:func:`unswap` and :func:`stats`; :func:`set_step_cache` for the transformer families' step cache; :func:`set_build_progress` for ``engines="auto"`` builds.

Run-time failures cost what they should (:mod:`.selection`): only an engine's own fault marks
it bad in the cache. The torch weights of engine-served modules are parked in a memory-mapped
spill file (:mod:`.weights`) and load on the first fallback. Every call first checks that those
weights are still the ones the engines were built from (:mod:`.freshness`: a LoRA, an edit): if not,
it runs torch with the reason, until ``sd_accel.refit_engines(pipe)`` updates the engines.
"""

from sd_accel.runtime.loader import engines_for, refusal, usable_handles
from sd_accel.runtime.selection import ComponentEngines, EngineHandle
from sd_accel.runtime.stats import ComponentStats
from sd_accel.runtime.swap import (
    set_build_progress,
    set_fallback,
    set_step_cache,
    stats,
    swap_engines,
    unswap,
)

__all__ = [
    "ComponentEngines",
    "ComponentStats",
    "EngineHandle",
    "engines_for",
    "refusal",
    "set_build_progress",
    "set_fallback",
    "set_step_cache",
    "stats",
    "swap_engines",
    "unswap",
    "usable_handles",
]
