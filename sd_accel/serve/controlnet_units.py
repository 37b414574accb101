"""sd-webui-controlnet's API units (``alwayson_scripts.controlnet.args``), read and checked.

The format A1111 clients send: one dict per unit with ``image`` (base64, optionally a data URI,
or ``{"image": ..., "mask": ...}``; older clients: ``input_image``), ``module`` (the
preprocessor), ``model`` (``"control_v11p_sd15_canny [d14c016b]"``: the hash in brackets is
dropped), ``weight``, ``guidance_start``/``guidance_end``, ``enabled``, ``control_mode``,
``threshold_a``/``threshold_b`` (canny's low/high), ``union_control_type`` (a FLUX.1 union net's
control type: its name as the net's card lists it, :data:`UNION_TYPES`, or its number). What sd-accel cannot do the same way is refused
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
# The control types of FLUX.1's union ControlNets (InstantX's and Shakker-Labs' cards: the
# same numbers), by the names people type; sd-webui-controlnet's own ``union_control_type``
# names are SDXL's union net's (other numbers), so only these names are read.
UNION_TYPES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "pose": 4, "openpose": 4, "gray": 5,
               "low quality": 6, "lq": 6}
_NO_UNION = (None, "", "unknown", "none", "auto")
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
    union_mode: int | None = None  # a FLUX.1 union net's control type (its number); None: a plain net

    def key(self) -> tuple:
        """What makes two units give the same call: everything, the image by its digest."""
        return (self.model, hashlib.sha256(self.image).hexdigest()[:20], self.module, self.weight,
                self.guidance_start, self.guidance_end, self.low, self.high, self.union_mode)

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


def _union_mode(unit: dict, where: str) -> int | None:
    value = unit.get("union_control_type")
    if value is None or (isinstance(value, str) and value.strip().lower() in _NO_UNION):
        return None
    if isinstance(value, str) and value.strip().lower() in UNION_TYPES:
        return UNION_TYPES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 16:
        return value
    names = ", ".join(n for n in UNION_TYPES if n not in ("openpose", "lq"))
    raise InvalidValue(f"{where}.union_control_type={value!r} is not a FLUX.1 union control type; allowed: "
                       f"{names}, or the type's number as the net's card gives it (0-15)")


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
            union_mode=_union_mode(unit, where),
        ))
    return units


def pipeline_arguments(units: list[ControlUnit], pipe=None) -> dict[str, Any]:
    """The ControlNet pipeline's call arguments for ``units`` (hint images made by their
    preprocessors): ``image`` (``control_image`` for ``pipe`` a FLUX.1 / SD3 pipeline),
    ``controlnet_conditioning_scale``, ``control_guidance_start/end``, FLUX.1's ``control_mode``."""
    import io

    from PIL import Image

    from sd_accel.api import control_arguments, control_hint

    hints = []
    for unit in units:
        image = Image.open(io.BytesIO(unit.image))
        hints.append(control_hint(image, unit.module) if unit.module != "canny" else _canny(image, unit))
    return control_arguments(hints, [u.weight for u in units], [u.guidance_start for u in units],
                             [u.guidance_end for u in units], pipe=pipe, modes=[u.union_mode for u in units])


def check_union_modes(units: list[ControlUnit], pipe) -> None:
    """Raise InvalidValue where a unit's ``union_control_type`` does not fit its net in ``pipe``
    (the ControlNet pipeline of the units' models, in their order): a type for a plain net, none
    for a union net (it needs one), or a number the net has no embedding for."""
    net = getattr(pipe, "controlnet", None)
    nets = list(getattr(net, "nets", None) or [net])
    for i, (unit, model) in enumerate(zip(units, nets, strict=False)):
        config = getattr(model, "config", None)
        modes = config.get("num_mode") if config is not None and hasattr(config, "get") else None
        where = f"alwayson_scripts.controlnet.args[{i}] ({unit.model})"
        if modes is None and unit.union_mode is not None:
            raise InvalidValue(f"{where}: union_control_type is for FLUX.1 union ControlNets and this net is not "
                               "one; leave it out")
        if modes is not None and unit.union_mode is None:
            raise InvalidValue(f"{where} is a union ControlNet ({modes} control types): send union_control_type "
                               f"({', '.join(n for n, k in UNION_TYPES.items() if k < modes)}, or its number)")
        if modes is not None and unit.union_mode >= modes:
            raise InvalidValue(f"{where}: union_control_type {unit.union_mode} is past the net's {modes} control "
                               f"types (0-{modes - 1})")


def _canny(image, unit: ControlUnit):
    from sd_accel.api import control_canny

    return control_canny(image, unit.low, unit.high)
