"""The runtime's public entry: the usable engines of one weights id and component.

Every face that runs calls on engines starts here: :func:`sd_accel.runtime.swap.swap_engines`
for diffusers pipelines, the WebUI adapter (``sd_accel.webui.controller``) for the WebUI's UNet,
and a server alike. An engine built for another backend, arch or backend version, or marked
bad, is never loaded; each refusal says why and what to do.

(Skipped in the test suite: it needs engines the WebUI or ComfyUI built from their own modules, for
a checkpoint file; tests/test_runtime_loader.py builds stand-ins.)

>>> engines = engines_for(cache, backend, "ckpt-0123abcd", "ldm_unet", fallback=False)  # doctest: +SKIP
>>> out = engines.run(feed)          # a covering engine's outputs, or None: run torch  # doctest: +SKIP
>>> engines.set_fallback(True)       # calls no engine covers now go to torch            # doctest: +SKIP
>>> engines.close()                  # drop loaded runners; engines_for again reloads    # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from sd_accel.runtime.selection import ComponentEngines, EngineHandle

if TYPE_CHECKING:  # hints only: the cache and the backends are below the runtime
    from sd_accel.backends.base import Backend, BackendInfo
    from sd_accel.cache.store import EngineCache, EngineRecord

log = logging.getLogger("sd_accel")

OnRefused = Callable[[str], None]  # told why an engine is not loaded, once per engine


def _log_refused(why: str) -> None:
    log.warning("not loading engine %s", why)


def refusal(record: EngineRecord, info: BackendInfo) -> str | None:
    """Why the engine of ``record`` cannot run on the backend ``info`` describes; None when it can.

    The backend, the arch and the backend version must match (an engine never crosses them)
    and the engine must not be marked bad.
    """
    key = record.key
    if key.backend != info.name:
        return f"{key.name} is a {key.backend} engine and the backend here is {info.name}: pick that backend"
    if key.arch != info.arch or key.backend_version != info.version:
        return (
            f"{key.name} was built for {key.arch} / {key.backend} {key.backend_version}, this machine is "
            f"{info.arch} / {info.version}: rebuild with build_engines(...) or `sd-accel build`"
        )
    if getattr(record, "status", "ok") != "ok":
        return f"{key.name} is marked bad ({record.bad_reason}); delete and rebuild it"
    return None


def usable_handles(cache: EngineCache, backend: Backend, model: str, component: str,
                   on_refused: OnRefused | None = None) -> list[EngineHandle]:
    """Handles (loaded on first use) of the engines in ``cache`` for weights id ``model`` and
    ``component`` that ``backend`` can run here; ``on_refused`` (default: a logged warning) hears
    why each other engine of that model and component is left out."""
    info = backend.info()
    tell = on_refused or _log_refused
    handles = []
    for record in cache.find(model=model, component=component, backend=backend.name):
        why = refusal(record, info)
        if why is not None:
            tell(why)
            continue
        handles.append(EngineHandle(record, backend, cache, info.arch, info.version))
    return handles


def engines_for(cache: EngineCache, backend: Backend, model: str, component: str, *, fallback: bool = True,
                prefer_precision: str | None = None, on_refused: OnRefused | None = None) -> ComponentEngines:
    """The engines of weights id ``model`` (a pipeline component's fingerprint, a WebUI weights id
    such as ``ckpt-<hash>+<loras>``) and ``component``, ready to serve calls.

    Only engines ``backend`` can run here are included (see :func:`refusal`; ``on_refused`` hears
    about the others, default: a logged warning); the result may hold none, and then every call
    falls back. ``fallback``: a call no engine covers runs torch (counted, said once) or, off,
    raises :class:`~sd_accel.core.EngineError`; switch it later with
    :meth:`ComponentEngines.set_fallback`. ``prefer_precision``: engines of that precision are
    tried first. To pick up engines built or deleted since, :meth:`ComponentEngines.close` this
    one and call again.
    """
    handles = usable_handles(cache, backend, model, component, on_refused)
    engines = ComponentEngines(component, handles, fallback, prefer_precision)
    engines.model = model
    return engines
