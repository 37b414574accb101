"""AUTOMATIC1111's ``/sdapi/v1/txt2img`` request and answer, mapped onto ``GenerationParams``.

The request's fields are validated by ``GenerationParams`` (one validation for every face); a
WebUI field that would change the image in a way sd-accel does not (hires fix, face restore,
scripts...) is refused with its name rather than silently dropped. Other unknown fields are
ignored and listed in the answer's ``info``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from sd_accel.core import InvalidValue
from sd_accel.generate import MAX_BATCH, GenerationParams
from sd_accel.serve.controlnet_units import ControlUnit, parse_controlnet_units

# Request field -> GenerationParams field.
FIELDS = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "steps": "steps",
    "cfg_scale": "cfg",
    "width": "width",
    "height": "height",
    "seed": "seed",
    "sampler_name": "sampler",
    "batch_size": "batch",
}
# The WebUI's defaults where they differ from GenerationParams' (a random seed, an empty prompt).
DEFAULTS: dict[str, Any] = {"prompt": "", "negative_prompt": "", "seed": -1, "batch_size": 1, "n_iter": 1}

# WebUI fields sd-accel serve does not implement: accepted only at a value that does nothing.
_OFF = (None, False)
REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "enable_hr": _OFF,
    "restore_faces": _OFF,
    "tiling": _OFF,
    "subseed_strength": (None, 0),
    "seed_resize_from_h": (None, -1, 0),
    "seed_resize_from_w": (None, -1, 0),
    "styles": (None, []),
    "script_name": (None, ""),
    "script_args": (None, []),
    "override_settings": (None, {}),
    "refiner_checkpoint": (None, ""),
}
# Fields that only matter to the WebUI's own saving, or to features above when they are off.
QUIET = {
    "n_iter", "send_images", "save_images", "sampler_index", "scheduler", "do_not_save_samples",
    "do_not_save_grid", "denoising_strength", "subseed", "eta", "s_min_uncond", "s_churn", "s_tmax", "s_tmin",
    "s_noise", "override_settings_restore_afterwards", "disable_extra_networks", "comments", "hr_scale",
    "hr_upscaler", "hr_second_pass_steps", "hr_resize_x", "hr_resize_y", "hr_checkpoint_name",
    "hr_sampler_name", "hr_scheduler", "hr_prompt", "hr_negative_prompt", "hr_cfg", "hr_distilled_cfg",
    "firstphase_width", "firstphase_height", "refiner_switch_at", "force_task_id", "infotext", "user",
    "distilled_cfg_scale", "script_name", "script_args", "alwayson_scripts", "styles", "override_settings",
}

# JSON types of the fields read here, checked before any value is looked at, so that a 5 where a
# name belongs is a 422 naming the field, not a TypeError deep in a validator (a 500).
_INT = ("an integer", (int,))
_NUMBER = ("a number", (int, float))
_TEXT = ("a string", (str,))
_NAME = ("a string or null", (str, type(None)))
_SIDE = ("an integer, or null for the model's size", (int, type(None)))
TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "prompt": _TEXT, "negative_prompt": _NAME, "steps": _INT, "cfg_scale": _NUMBER, "width": _SIDE,
    "height": _SIDE, "seed": _INT, "batch_size": _INT, "n_iter": _INT, "sampler_name": _NAME,
    "sampler_index": _NAME, "scheduler": _NAME, "send_images": ("true or false", (bool,)),
}
# Deeper than any WebUI body (alwayson_scripts args nest 4-5 levels); bounds the work of echoing
# and encoding what a client sent.
MAX_DEPTH = 32


def check_json(body: Any, max_depth: int = MAX_DEPTH, route: str = "txt2img") -> None:
    """Refuse (``InvalidValue`` naming the field) nesting deeper than ``max_depth`` and numbers JSON
    cannot carry back (NaN, Infinity: Python's reader takes them, the answer's writer refuses them).

    Walks without recursion, so no body can raise ``RecursionError`` here.
    """
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidValue(f"{route} field {path or '(body)'}={value} is not valid; allowed: a finite number")
        if isinstance(value, dict | list):
            if depth >= max_depth:
                raise InvalidValue(f"{route} field {path or '(body)'} nests deeper than {max_depth} levels; "
                                   "no WebUI field needs that")
            if isinstance(value, dict):
                stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in value.items())
            else:
                stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_types(body: dict[str, Any], route: str = "txt2img") -> None:
    for name, (allowed, types) in TYPES.items():
        if name not in body:
            continue
        value = body[name]
        # JSON true is a Python int: only send_images takes it.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise InvalidValue(f"{route} field {name}={_short(value)} is not valid; allowed: {allowed}")


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Txt2ImgRequest:
    """A validated request: ``params`` covers every image (``batch`` = batch_size x n_iter,
    seed resolved), plus what the answer echoes."""

    params: GenerationParams
    batch_size: int
    n_iter: int
    send_images: bool
    body: dict[str, Any]
    ignored: tuple[str, ...] = field(default=())
    control: tuple[ControlUnit, ...] = field(default=())  # alwayson_scripts.controlnet's enabled units
    init_image: bytes | None = None  # img2img (serve/img2img.py): the encoded init image
    strength: float | None = None  # img2img: denoising_strength

    def backend_request(self) -> dict[str, Any]:
        """What the replica is sent: GenerationParams fields, ``controlnet`` units when there are
        some, and img2img's ``init_image`` and ``strength``."""
        request = self.params.to_dict()
        if self.control:
            request["controlnet"] = [unit.to_dict() for unit in self.control]
        if self.init_image is not None:
            request["init_image"] = self.init_image
            request["strength"] = self.strength
        return request


def _always_on(body: dict[str, Any], route: str = "txt2img") -> tuple[ControlUnit, ...]:
    """The ControlNet units of ``alwayson_scripts``; any other script that has arguments is refused
    by name (it would change the image in a way sd-accel does not)."""
    scripts = body.get("alwayson_scripts")
    if scripts in (None, {}):
        return ()
    if not isinstance(scripts, dict):
        raise InvalidValue(f"{route} field alwayson_scripts={_short(scripts)} is not valid; allowed: an object "
                           'of scripts, e.g. {"controlnet": {"args": [unit, ...]}}')
    for name, script in scripts.items():
        args = script.get("args") if isinstance(script, dict) else script
        if name.lower() != "controlnet" and args not in (None, [], {}):
            raise InvalidValue(f"{route} field alwayson_scripts.{name} is not supported by sd-accel serve (of the "
                               "always-on scripts only controlnet is); leave it out")
    return tuple(parse_controlnet_units({k.lower(): v for k, v in scripts.items()}))


def parse_txt2img(body: Any, route: str = "txt2img") -> Txt2ImgRequest:
    """Map a WebUI txt2img body onto ``GenerationParams``; ``InvalidValue`` names the bad field.

    >>> parse_txt2img({"prompt": "a cat", "width": 100}).params
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: GenerationParams.width=100 is not valid; allowed: a multiple of 8 from 8 to 4096, or None for the model's default
    """
    if not isinstance(body, dict):
        raise InvalidValue(f"the {route} body must be a JSON object, got {type(body).__name__}")
    check_json(body, route=route)
    _check_types(body, route)
    for name, harmless in REFUSED_UNLESS.items():
        if name in body and body[name] not in harmless:
            raise InvalidValue(
                f"{route} field {name}={_short(body[name])} is not supported by sd-accel serve; leave it out "
                "or set it to " + " / ".join(json.dumps(v) for v in harmless)
            )
    control = _always_on(body, route)
    kwargs = {dst: body.get(src, DEFAULTS.get(src)) for src, dst in FIELDS.items()
              if src in body or src in DEFAULTS}
    if "sampler_name" not in body and body.get("sampler_index"):
        kwargs["sampler"] = body["sampler_index"]  # the WebUI's older name for it
    schedule = body.get("scheduler")
    if schedule not in (None, "", "Automatic", "automatic"):
        if not kwargs.get("sampler"):
            raise InvalidValue(f"{route} field scheduler={schedule!r} needs a sampler_name to go with it")
        from sd_accel.samplers import resolve

        if not isinstance(schedule, str):
            raise InvalidValue(f"{route} field scheduler={schedule!r} must be a schedule name such as 'Karras'")
        kwargs["sampler"] = resolve(str(kwargs["sampler"]), schedule).name
    if kwargs.get("negative_prompt") == "":
        kwargs["negative_prompt"] = None
    params = GenerationParams(**kwargs)
    n_iter = body.get("n_iter", 1)
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or not 1 <= n_iter <= MAX_BATCH:
        raise InvalidValue(f"{route} field n_iter={n_iter!r} is not valid; allowed: an integer from 1 to {MAX_BATCH}")
    if params.batch * n_iter > MAX_BATCH:
        raise InvalidValue(f"batch_size x n_iter = {params.batch * n_iter} images; at most {MAX_BATCH} per request")
    send = body.get("send_images", True)
    if not isinstance(send, bool):
        raise InvalidValue(f"{route} field send_images={send!r} must be true or false")
    params = dataclasses.replace(params, batch=params.batch * n_iter, seed=params.resolved_seed())
    ignored = tuple(sorted(k for k in body if k not in FIELDS and k not in QUIET and k not in REFUSED_UNLESS))
    return Txt2ImgRequest(params, params.batch // n_iter, n_iter, send, dict(body), ignored, control)


def txt2img_answer(request: Txt2ImgRequest, result: dict[str, Any]) -> dict[str, Any]:
    """The WebUI's answer: ``images`` (base64 PNGs, each with its ``parameters`` text chunk),
    ``parameters`` (the request with defaults filled in) and ``info`` (a JSON string)."""
    p = request.params
    n = len(result["seeds"])
    parameters = {src: getattr(p, dst) for src, dst in FIELDS.items()}
    parameters.update(
        {"prompt": p.prompt, "negative_prompt": p.negative_prompt or "", "batch_size": request.batch_size,
         "n_iter": request.n_iter, "seed": request.body.get("seed", DEFAULTS["seed"]),
         "width": result["width"], "height": result["height"], "sampler_name": result["sampler"],
         "send_images": request.send_images, "save_images": False}
    )
    for key, value in request.body.items():
        parameters.setdefault(key, value)
    info = {
        "prompt": p.prompt,
        "all_prompts": [p.prompt] * n,
        "negative_prompt": p.negative_prompt or "",
        "all_negative_prompts": [p.negative_prompt or ""] * n,
        "seed": result["seeds"][0],
        "all_seeds": result["seeds"],
        "subseed": -1,
        "all_subseeds": [-1] * n,
        "subseed_strength": 0,
        "width": result["width"],
        "height": result["height"],
        "sampler_name": result["sampler"],
        "cfg_scale": p.cfg,
        "steps": p.steps,
        "batch_size": request.batch_size,
        "sd_model_name": result["model"],
        "infotexts": result["infotexts"],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "sd_accel": {
            "replica": result.get("replica"),
            "call_sizes": result.get("call_sizes"),
            "seconds": result.get("seconds"),
            "ignored_fields": list(request.ignored),
            "warnings": result.get("warnings", []),
        },
    }
    images = [base64.b64encode(png).decode("ascii") for png in result["images"]] if request.send_images else []
    return {"images": images, "parameters": parameters, "info": json.dumps(info)}
