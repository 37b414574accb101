"""HTTP routes for headless use, added to the WebUI's FastAPI app (``on_app_started``).

- ``GET /sd-accel/engines``: every engine in the engine directory, with the checkpoint it is for
  and whether it loads on this machine; the intermediates kept beside them (ONNX exports,
  calibration data) and the bytes of both (``total_bytes``);
- ``POST /sd-accel/build``: build engines for a checkpoint (default: the loaded one), body
  ``{"checkpoint": "...", "preset": "static-512", "profile": {...}, "backend": "auto",
  "precision": "auto"}``; answers when the build is done (minutes for TensorRT);
- ``DELETE /sd-accel/engines/{name}``: delete one engine.
"""

from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from sd_accel.runtime import refusal
from sd_accel.webui.controller import Controller, controller

PREFIX = "/sd-accel"


class BuildBody(BaseModel):
    """``POST /sd-accel/build``. ``profile`` is ``{"batch": [1, 1, 4], "height": 512, ...}``
    (ints or [min, opt, max]); give it or ``preset`` (default: the settings' preset)."""

    checkpoint: str | None = None
    preset: str | None = None
    profile: dict | None = None
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


def register(app: FastAPI, ctl: Controller | None = None) -> None:
    """Add the routes to ``app`` (the WebUI's FastAPI app)."""
    ctl = ctl or controller()

    def list_engines() -> dict[str, Any]:
        cache = ctl.cache()
        try:
            info = ctl.backend().info()
        except Exception:  # no usable backend: list the engines anyway, none usable
            info = None

        def usable(r) -> bool:
            return info is not None and refusal(r, info) is None

        usage = cache.disk_usage()
        return {"engine_dir": str(cache.root), "engines": [engine_json(r, usable(r)) for r in cache.list()],
                "intermediates": [i.to_dict() for i in usage.intermediates], "engines_bytes": usage.engines_bytes,
                "intermediates_bytes": usage.intermediates_bytes, "total_bytes": usage.total_bytes}

    def build(body: BuildBody) -> dict[str, Any]:
        from sd_accel.webui.jobs import BuildRefused, build_for_checkpoint

        try:
            records = build_for_checkpoint(body.checkpoint, preset=body.preset, profile=body.profile,
                                           backend=body.backend, precision=body.precision, ctl=ctl)
        except BuildRefused as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from exc
        except (ValueError, RuntimeError) as exc:  # bad profile, unusable backend, failed build
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"built": [engine_json(r) for r in records]}

    def delete_engine(name: str) -> dict[str, Any]:
        try:
            existed = ctl.cache().delete(name)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        if not existed:
            raise HTTPException(status_code=404, detail=f"no engine named {name}")
        ctl.engines_changed()
        return {"deleted": name}

    app.add_api_route(f"{PREFIX}/engines", list_engines, methods=["GET"])
    app.add_api_route(f"{PREFIX}/build", build, methods=["POST"])
    app.add_api_route(PREFIX + "/engines/{name}", delete_engine, methods=["DELETE"])
