"""The HTTP face of ``sd-accel serve``: a FastAPI app over a backend that generates.

Routes (every one behind the bearer token when one is set, the docs and unknown paths included):

- ``POST /sdapi/v1/txt2img``: AUTOMATIC1111-compatible; 413 for a body over
  ``max_request_bytes`` (before it is parsed), 422 naming the field of a bad request (before it
  reaches any queue), 503 with ``Retry-After`` when the replicas are full or one died
  under it, 504 when it ran past ``request_timeout_s``;
- ``POST /sdapi/v1/img2img``: the same, with one init image and its ``denoising_strength``
  (``img2img.py``: no inpainting);
- ``GET /sdapi/v1/samplers``: the sampler names, as the WebUI lists them;
- ``GET /controlnet/model_list``, ``/controlnet/module_list``: sd-webui-controlnet's, for the
  ControlNets of ``controlnet_dir`` and the preprocessors built in (none, canny);
- ``GET /sd-accel/engines``: the engine cache the replicas read;
- ``GET /sd-accel/health``: 200 when a replica can take requests, else 503 (also while shutting down).

A shutdown drains the ingress first (``Lifecycle``): no request is left without an answer.

The backend is Ray Serve's model deployment in production (``deployment.py``) and a stand-in in
tests; this module imports no Ray (FastAPI comes with Ray Serve and with Gradio).
"""

import asyncio
import hmac
import json
import math
import time
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sd_accel.core import InvalidValue, SdAccelError
from sd_accel.serve.config import ServeConfig
from sd_accel.serve.img2img import parse_img2img
from sd_accel.serve.txt2img import MAX_DEPTH, parse_txt2img, txt2img_answer


class Busy(SdAccelError, RuntimeError):
    """Every replica is full; retry after a while (HTTP 503 with Retry-After)."""


class Unavailable(SdAccelError, RuntimeError):
    """No replica could finish the request (it died under it, or none is running): HTTP 503."""


class Backend(Protocol):
    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``request``: GenerationParams fields (and ``controlnet``: ControlUnit dicts). Raises Busy,
        Unavailable or InvalidValue."""

    async def health(self) -> dict[str, Any]:
        """``{"ok": bool, ...}``: whether a replica can take requests, and details."""


class BearerAuth:
    """ASGI middleware: every HTTP and websocket request needs ``Authorization: Bearer <token>``."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._token = ("Bearer " + token).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(header, self._token):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="sd-accel"'),
            (b"content-length", str(len(body)).encode()),
        ]})
        await send({"type": "http.response.body", "body": body})


class Stopped(SdAccelError, RuntimeError):
    """The service shut down before this request finished (HTTP 503)."""


class Lifecycle:
    """The ingress's part in a shutdown: ``drain`` refuses new requests (503), waits up to a
    grace period for the running ones, then answers those still running 503, so no client is
    left with a dropped connection."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self.stop = asyncio.Event()

    async def drain(self, grace_s: float) -> dict[str, int]:
        """Returns how many requests were running, and how many of them the grace period cut short."""
        self.draining = True
        running = self.inflight
        deadline = time.monotonic() + grace_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = self.inflight
        if cut:
            self.stop.set()
            deadline = time.monotonic() + 5.0  # their 503s are written at once; bounded anyway
            while self.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return {"running": running, "cut_short": cut}

    async def until_stopped(self, work):
        """``await work``, unless a drain's grace period ends first: then ``Stopped``."""
        job = asyncio.ensure_future(work)
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({job, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if job in done:
                return job.result()
            raise Stopped("sd-accel serve shut down before this request finished; retry")
        finally:  # the client went away, or the stop: never leave either behind
            for task in (job, stopper):
                if not task.done():
                    task.cancel()


def engine_listing(engine_dir: str | None) -> dict[str, Any]:
    """The engine cache as JSON: every engine with its key fields, size, status and last use."""
    from sd_accel import EngineCache

    cache = EngineCache(engine_dir)
    engines = []
    for r in sorted(cache.list(), key=lambda r: r.name):
        engines.append({
            "name": r.name,
            "component": r.key.component,
            "weights": r.key.model,
            "profile": r.key.profile,
            "precision": r.key.precision,
            "backend": r.key.backend,
            "backend_version": r.key.backend_version,
            "arch": r.key.arch,
            "shapes": {k: [list(s) for s in v] for k, v in r.shapes.items()},
            "size_bytes": r.size_bytes,
            "status": r.status,
            "bad_reason": r.bad_reason,
            "last_used": r.last_used,
        })
    return {"engine_dir": str(cache.root), "engines": engines,
            "broken": [{"name": b.name, "reason": b.reason} for b in cache.broken()]}


def build_app(config: ServeConfig, backend: Backend) -> FastAPI:
    """The FastAPI app for ``config``, generating through ``backend``."""
    app = FastAPI(title="sd-accel serve", version="1")
    retry_after = str(max(1, math.ceil(config.retry_after_s)))
    # Admission: what the replicas hold plus the queue in front of them. Counted here, not left to
    # Ray's max_queued_requests alone, because Ray counts a burst as queued before it assigns it
    # and so refuses part of a burst that the replicas have room for.
    capacity = config.num_replicas * config.max_ongoing_requests + config.max_queued_requests
    life = Lifecycle()
    app.state.lifecycle = life

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"detail": message, "error": _ERRORS.get(status, "Error")}, status, headers=headers)

    limit = config.max_request_bytes

    def too_large(size: str) -> JSONResponse:
        return error(413, f"the request body is {size} bytes; at most {limit} are taken (max_request_bytes, "
                          "--max-request-bytes): send a shorter prompt")

    @app.post("/sdapi/v1/txt2img")
    async def txt2img(request: Request):
        return await answer(request, parse_txt2img, "txt2img")

    @app.post("/sdapi/v1/img2img")
    async def img2img(request: Request):
        return await answer(request, parse_img2img, "img2img")

    async def answer(request: Request, parse, kind: str):
        # Refused before it is read whole, let alone parsed: a 10 MB prompt costs nothing.
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return too_large(declared)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_large(f"more than {limit}")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            return error(422, f"the body must be a JSON object of {kind} fields, nested at most "
                              f"{MAX_DEPTH} levels (Content-Type: application/json)")
        try:
            req = parse(body)
        except InvalidValue as exc:
            return error(422, str(exc))  # before any queue: a bad request costs no replica time
        if life.draining:
            return error(503, "sd-accel serve is shutting down; retry later (or on another instance)",
                         {"Retry-After": retry_after})
        if life.inflight >= capacity:
            return error(503, f"all {capacity} places (replicas and queue) are taken; retry later",
                         {"Retry-After": retry_after})
        life.inflight += 1
        started = time.perf_counter()
        try:
            result = await life.until_stopped(asyncio.wait_for(backend.generate(req.backend_request()),
                                                               timeout=config.request_timeout_s))
        except Stopped as exc:
            return error(503, str(exc), {"Retry-After": retry_after})
        except asyncio.TimeoutError:
            return error(504, f"the request ran past request_timeout_s={config.request_timeout_s:g} s and was "
                              "cancelled; retry, or ask for fewer steps or images")
        except Busy as exc:
            return error(503, str(exc), {"Retry-After": retry_after})
        except Unavailable as exc:
            return error(503, str(exc), {"Retry-After": retry_after})
        except InvalidValue as exc:
            return error(422, str(exc))
        except Exception as exc:  # the pipeline failed: say why in one line (Ray adds the remote traceback)
            lines = [line for line in str(exc).splitlines() if line.strip()]
            return error(500, f"generation failed: {lines[-1] if lines else type(exc).__name__}")
        finally:
            life.inflight -= 1
        answer = txt2img_answer(req, result)
        return JSONResponse(answer, headers={"X-Process-Time": f"{time.perf_counter() - started:.3f}"})

    @app.get("/sdapi/v1/samplers")
    async def samplers():
        from sd_accel.samplers import list_presets

        return [{"name": name, "aliases": [], "options": {}} for name in list_presets(available_only=True)]

    # sd-webui-controlnet's routes, which its clients read to fill their menus.
    @app.get("/controlnet/model_list")
    async def controlnet_models():
        from sd_accel.serve.controlnet_units import controlnet_files

        return {"model_list": sorted(await asyncio.to_thread(controlnet_files, config.controlnet_dir))}

    @app.get("/controlnet/module_list")
    async def controlnet_modules():
        from sd_accel.serve.controlnet_units import PREPROCESSORS

        return {"module_list": list(dict.fromkeys(PREPROCESSORS.values()))}

    @app.get("/sd-accel/engines")
    async def engines():
        return await asyncio.to_thread(engine_listing, config.engine_dir)

    @app.get("/sd-accel/health")
    async def health():
        if life.draining:
            return JSONResponse({"ok": False, "status": "shutting down"}, 503, headers={"Retry-After": retry_after})
        state = await backend.health()
        return JSONResponse(state, 200 if state.get("ok") else 503,
                            headers=None if state.get("ok") else {"Retry-After": retry_after})

    if config.token:
        app.add_middleware(BearerAuth, token=config.token)  # outermost: before routing, docs and 404s
    return app


_ERRORS = {401: "Unauthorized", 413: "PayloadTooLarge", 422: "InvalidValue", 500: "GenerationFailed", 503: "ServiceUnavailable", 504: "Timeout"}
