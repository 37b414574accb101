"""sd-webui-controlnet's API units (``alwayson_scripts.controlnet.args``), read and checked.

The format A1111 clients send: one dict per unit with ``image`` (base64, optionally a data URI,
or ``{"image": ..., "mask": ...}``; older clients: ``input_image``), ``module`` (the
preprocessor), ``model`` (``"control_v11p_sd15_canny [d14c016b]"``: the hash in brackets is
dropped), ``weight``, ``guidance_start``/``guidance_end``, ``enabled``, ``control_mode``,
``threshold_a``/``threshold_b`` (canny's low/high). What sd-accel cannot do the same way is refused
by name rather than ignored: preprocessors other than ``none`` and ``canny`` (send the hint
image itself), and the extension's ``control_mode`` weighting other than ``Balanced``.

The replica maps each unit's model name to a file or diffusers folder of the service's
``controlnet_dir`` (:func:`controlnet_files`) and batches requests whose units are equal
(:meth:`ControlUnit.key`: the image by its digest).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_accel.core import InvalidValue

PREPROCESSORS = {"none": "none", "canny": "canny", "": "none", None: "none"}
_BALANCED = ("Balanced", 0, None)
_HASH = re.compile(r"\s*\[[0-9a-fA-F]{6,}\]\s*$")


@dataclass(frozen=True)
class ControlUnit:
    """One enabled ControlNet unit of a request."""

    model: str  # the name without its ``[hash]``
    image: bytes  # the encoded image (PNG, JPEG, ...), as sent
    module: str = "none"  # "none" or "canny"
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    low: float = 100.0  # canny thresholds (threshold_a, threshold_b)
    high: float = 200.0

    def key(self) -> tuple:
        """What makes two units give the same call: everything, the image by its digest."""
        return (self.model, hashlib.sha256(self.image).hexdigest()[:20], self.module, self.weight,
                self.guidance_start, self.guidance_end, self.low, self.high)

    @staticmethod
    def models(keys: tuple) -> tuple[str, ...]:
        """The ControlNet names of a tuple of :meth:`key` values (what picks the pipeline)."""
        return tuple(k[0] for k in keys)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for the replica's handle (``ControlUnit(**data)`` reads it back)."""
        return dataclasses.asdict(self)


# The suffixes of the ControlNet files people download (pickle ones load only with allow_pickle).
FILE_SUFFIXES = (".safetensors", ".pth", ".ckpt", ".pt", ".bin")


def controlnet_files(folder: str | Path | None) -> dict[str, Path]:
    """The ControlNets of ``folder`` by the name a request gives: each single file by its stem,
    each diffusers folder (one holding ``config.json``) by its name. Empty without a folder."""
    if folder is None:
        return {}
    found: dict[str, Path] = {}
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_file() and entry.suffix.lower() in FILE_SUFFIXES and not entry.name.startswith("."):
            found.setdefault(entry.stem, entry)
        elif entry.is_dir() and (entry / "config.json").is_file():
            found.setdefault(entry.name, entry)
    return found


def _number(unit: dict, name: str, default: float, lo: float, hi: float, where: str) -> float:
    value = unit.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidValue(f"{where}.{name}={value!r} is not valid; allowed: a number from {lo} to {hi}")
    return float(value)


def _image(unit: dict, where: str) -> bytes:
    raw = unit.get("image", unit.get("input_image"))
    if isinstance(raw, dict):
        raw = raw.get("image")
    if not isinstance(raw, str) or not raw:
        raise InvalidValue(f"{where}.image is missing: send the hint image as base64 (or a data URI)")
    if raw.startswith("data:"):
        raw = raw.split(",", 1)[-1]
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidValue(f"{where}.image is not valid base64 ({exc})") from None


def parse_controlnet_units(alwayson: Any) -> list[ControlUnit]:
    """The enabled units of an ``alwayson_scripts`` dict (empty when it has no ``controlnet``).

    >>> parse_controlnet_units({"controlnet": {"args": [{"enabled": False}]}})
    []
    """
    if not alwayson:
        return []
    if not isinstance(alwayson, dict):
        raise InvalidValue("alwayson_scripts must be an object")
    script = alwayson.get("controlnet") or alwayson.get("ControlNet")
    if script is None:
        return []
    args = script.get("args") if isinstance(script, dict) else None
    if not isinstance(args, list):
        raise InvalidValue('alwayson_scripts.controlnet must be {"args": [unit, ...]}')
    units = []
    for i, unit in enumerate(args):
        where = f"alwayson_scripts.controlnet.args[{i}]"
        if not isinstance(unit, dict):
            raise InvalidValue(f"{where} must be an object")
        if not unit.get("enabled", True):
            continue
        module = unit.get("module")
        if module not in PREPROCESSORS:
            raise InvalidValue(f"{where}.module={module!r}: sd-accel builds in only the canny preprocessor; "
                               "send the hint image itself with module 'none'")
        if unit.get("control_mode") not in _BALANCED:
            raise InvalidValue(f"{where}.control_mode={unit.get('control_mode')!r} is not supported; use 'Balanced'")
        model = unit.get("model")
        if not isinstance(model, str) or not _HASH.sub("", model) or model == "None":
            raise InvalidValue(f"{where}.model is missing: name the ControlNet (as the WebUI lists it)")
        start = _number(unit, "guidance_start", 0.0, 0.0, 1.0, where)
        end = _number(unit, "guidance_end", 1.0, 0.0, 1.0, where)
        if start > end:
            raise InvalidValue(f"{where}: guidance_start {start} is after guidance_end {end}")
        units.append(ControlUnit(
            model=_HASH.sub("", model), image=_image(unit, where), module=PREPROCESSORS[module],
            weight=_number(unit, "weight", 1.0, 0.0, 2.0, where), guidance_start=start, guidance_end=end,
            low=_number(unit, "threshold_a", 100.0, 0.0, 255.0, where) if module == "canny" else 100.0,
            high=_number(unit, "threshold_b", 200.0, 0.0, 255.0, where) if module == "canny" else 200.0,
        ))
    return units


def pipeline_arguments(units: list[ControlUnit]) -> dict[str, Any]:
    """The ControlNet pipeline's call arguments for ``units`` (hint images made by their
    preprocessors): ``image``, ``controlnet_conditioning_scale``, ``control_guidance_start/end``."""
    import io

    from PIL import Image

    from sd_accel.api import control_arguments, control_hint

    hints = []
    for unit in units:
        image = Image.open(io.BytesIO(unit.image))
        hints.append(control_hint(image, unit.module) if unit.module != "canny" else _canny(image, unit))
    return control_arguments(hints, [u.weight for u in units], [u.guidance_start for u in units],
                             [u.guidance_end for u in units])


def _canny(image, unit: ControlUnit):
    from sd_accel.api import control_canny

    return control_canny(image, unit.low, unit.high)
