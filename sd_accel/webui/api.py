"""HTTP routes for headless use, added to the WebUI's FastAPI app (``on_app_started``).

- ``GET /sd-accel/engines``: every engine in the engine directory, with the checkpoint it is for
  and whether it loads on this machine, plus the intermediates kept beside them (ONNX exports, calibration data)
  and the bytes of both (``total_bytes``; ``disk`` splits them by kind);
- ``POST /sd-accel/build``: build engines for a checkpoint (default: the loaded one, loaded
  first when the WebUI has none yet), body ``{"checkpoint": "...", "preset": "static-512",
  "profile": {...}, "components": ["unet", "vae_decoder", "clip"], "backend": "auto",
  "precision": "auto"}``; answers when the build is done (minutes);
- ``DELETE /sd-accel/engines/{name}``: delete one engine (and the ONNX export no engine needs
  any more).

**The WebUI's rules for its API apply.** The routes exist only when the WebUI serves its own API
(``--api``, or ``--nowebui``): that is when the WebUI has mounted ``/sdapi/v1/*`` by the time
``on_app_started`` runs, so the routes are added exactly when those are. Each route carries the
same dependencies as the WebUI's own ``/sdapi/v1`` routes, which is the WebUI's ``--api-auth``
HTTP basic auth (``Api.auth``) when it is on: the same users, the same 401.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from sd_accel.runtime import refusal
from sd_accel.webui.console import say
from sd_accel.webui.controller import Controller, controller

log = logging.getLogger("sd_accel")

PREFIX = "/sd-accel"
SDAPI_PREFIX = "/sdapi/v1/"
API_OWN_ROUTE = SDAPI_PREFIX + "options"  # added by the WebUI's Api class itself (A1111 1.x, Forge 1 and 2)
LIST_ROUTE = f"GET {PREFIX}/engines"


class BuildBody(BaseModel):
    """``POST /sd-accel/build``. ``profile`` is ``{"batch": [1, 1, 4], "height": 512, ...}``
    (ints or [min, opt, max]); give it or ``preset`` (default: the settings' preset).
    ``components``: any of ``unet``, ``vae_decoder``, ``vae_encoder``, ``clip`` and, on Forge,
    ``unet_control`` (the UNet taking ControlNet residuals) (default: ``unet``, ``vae_decoder``
    and ``clip``)."""

    checkpoint: str | None = None
    preset: str | None = None
    profile: dict | None = None
    components: list[str] | None = None
    backend: str = "auto"
    precision: str = "auto"


def engine_json(record, usable: bool | None = None) -> dict[str, Any]:
    """One engine as JSON: name, key fields, shapes, size, status and the WebUI facts."""
    data = {
        "name": record.name,
        "component": record.key.component,
        "weights": record.key.model,
        "backend": record.key.backend,
        "backend_version": record.key.backend_version,
        "arch": record.key.arch,
        "precision": record.key.precision,
        "profile": record.key.profile,
        "shapes": {k: [list(s) for s in v] for k, v in record.shapes.items()},
        "size_bytes": record.size_bytes,
        "status": record.status,
        "bad_reason": record.bad_reason,
        "last_used": record.last_used,
        "validation": record.validation,
        "webui": (record.extra or {}).get("webui"),
    }
    if usable is not None:
        data["usable_here"] = usable
    return data


def webui_api_dependencies(app: FastAPI) -> list | None:
    """The dependencies of the WebUI's own API routes (its ``--api-auth`` check when that is on),
    or None when the WebUI serves no API (no ``/sdapi/v1/options`` route on ``app``).

    Only a route the WebUI's ``Api`` class adds counts: other ``/sdapi/v1`` paths can be there
    without ``--api`` and without its auth (A1111's built-in Lora extension adds
    ``/sdapi/v1/loras`` in ``on_app_started`` in every start)."""
    for route in getattr(app, "routes", ()):
        if getattr(route, "path", None) == API_OWN_ROUTE and hasattr(route, "dependencies"):
            return list(route.dependencies)
    return None


def register(app: FastAPI, ctl: Controller | None = None) -> bool:
    """Add the routes to ``app`` (the WebUI's FastAPI app) when the WebUI serves its API; True if added."""
    dependencies = webui_api_dependencies(app)
    if dependencies is None:
        say("HTTP routes off: the WebUI serves no API (start it with --api to get "
            f"{PREFIX}/*, under the same --api-auth as /sdapi/v1)")
        return False
    ctl = ctl or controller()

    def list_engines() -> dict[str, Any]:
        from sd_accel.webui.disk import disk_totals

        cache = ctl.cache()
        try:
            info = ctl.backend().info()
        except Exception:  # no usable backend: list the engines anyway, none usable
            info = None

        def usable(r) -> bool:
            return info is not None and refusal(r, info) is None

        usage = cache.disk_usage()
        return {"engine_dir": str(cache.root), "engines": [engine_json(r, usable(r)) for r in cache.list()],
                "intermediates": [i.to_dict() for i in usage.intermediates],
                "refit_copies": [c.to_dict() for c in usage.refit_copies], "engines_bytes": usage.engines_bytes,
                "intermediates_bytes": usage.intermediates_bytes, "total_bytes": usage.total_bytes,
                "disk": disk_totals(cache, usage)}

    def build(body: BuildBody) -> dict[str, Any]:
        from sd_accel.core import BuildCancelled, SdAccelError
        from sd_accel.webui.console import console_progress
        from sd_accel.webui.jobs import BuildRefused, build_for_checkpoint

        not_built: list[str] = []
        try:
            records = build_for_checkpoint(body.checkpoint, preset=body.preset, profile=body.profile,
                                           components=body.components, backend=body.backend,
                                           precision=body.precision, ctl=ctl, skipped=not_built,
                                           progress=console_progress("API build"))
        except BuildRefused as exc:
            say(f"build refused ({exc.status}): {exc}")
            raise HTTPException(status_code=exc.status, detail=str(exc)) from exc
        except BuildCancelled as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except Exception as exc:  # a bad profile, an unusable backend, a failed export or build
            say(f"build failed:\n{traceback.format_exc()}")
            # sd-accel's own errors say what to do (a bad request, a failed validation): 400;
            # anything else is a bug or the host's failure: 500. The message reaches the client.
            status = 400 if isinstance(exc, (ValueError, SdAccelError)) else 500
            raise HTTPException(status_code=status, detail=f"build failed: {type(exc).__name__}: {exc}") from exc
        say(f"API build done: {len(records)} engine(s)" + (f"; not built: {'; '.join(not_built)}" if not_built else ""))
        return {"built": [engine_json(r) for r in records], "not_built": not_built}

    def delete_engine(name: str) -> dict[str, Any]:
        from sd_accel.webui.disk import delete_engine as delete

        cache = ctl.cache()
        if not any(r.name == name for r in cache.list()):
            raise HTTPException(status_code=404, detail=f"no engine named {name!r} in {cache.root}; "
                                                        f"{LIST_ROUTE} lists their names")
        try:
            freed = delete(cache, name)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        ctl.engines_changed()
        return {"deleted": name, "onnx_removed": freed}

    app.add_api_route(f"{PREFIX}/engines", list_engines, methods=["GET"], dependencies=dependencies)
    app.add_api_route(f"{PREFIX}/build", build, methods=["POST"], dependencies=dependencies)
    app.add_api_route(PREFIX + "/engines/{name}", delete_engine, methods=["DELETE"], dependencies=dependencies)
    auth = "the WebUI's --api-auth" if dependencies else "no auth (as /sdapi/v1: the WebUI has no --api-auth)"
    say(f"HTTP routes {PREFIX}/engines, {PREFIX}/build added, with {auth}")
    return True
