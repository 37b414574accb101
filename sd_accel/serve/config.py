"""``ServeConfig``: everything ``sd-accel serve`` needs, from arguments or a small YAML/JSON file.

No Ray here: the CLI and the tests read and validate configs without importing it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sd_accel.config import AccelConfig
from sd_accel.core import InvalidValue

TOKEN_ENV = "SD_ACCEL_SERVE_TOKEN"
LOOPBACK = "127.0.0.1"


def _bad(name: str, value: Any, allowed: str) -> None:
    raise InvalidValue(f"ServeConfig.{name}={value!r} is not valid; allowed: {allowed}")


def _int_at_least(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        _bad(name, value, f"an integer >= {lo}")


def _number_at_least(name: str, value: Any, lo: float, strict: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < lo or (strict and value == lo):
        _bad(name, value, f"a number {'>' if strict else '>='} {lo}")


@dataclass
class ServeConfig:
    """One ``sd-accel serve`` deployment: the model, how it is accelerated, and how it is served.

    - ``model``, ``allow_pickle``, ``accel`` (an ``AccelConfig`` or its fields as a dict) and
      ``engine_dir`` (one folder every replica reads; shared storage on a cluster): what each
      replica loads. ``accel.engines`` is on unless you turn it off.
    - ``host`` (127.0.0.1 unless you open it), ``port``, ``token`` (a bearer token every route
      checks; default ``$SD_ACCEL_SERVE_TOKEN``).
    - ``num_replicas``, ``num_cpus``, ``num_gpus``: replicas and what Ray reserves for each
      (one replica per GPU: ``num_gpus=1``).
    - ``max_batch_size``: the most images one pipeline call takes (the engines' batch range caps
      it further); ``batch_wait_ms``: how long a request may wait for others to share its call
      (None: by where the UNet runs, see ``replica.default_batch_wait_ms``; a call always takes
      the compatible requests already waiting, whatever the wait).
    - ``max_ongoing_requests``: requests one replica holds (running and waiting for a batch);
      ``max_queued_requests``: requests waiting for a replica slot (for the whole application);
      past ``num_replicas * max_ongoing_requests + max_queued_requests``, 503 with
      ``Retry-After: retry_after_s``. ``request_timeout_s``: past it a request is cancelled (504).
      ``max_request_bytes`` (1 MiB): a larger body is refused (413) before it is read.
      ``shutdown_grace_s``: on Ctrl-C or SIGTERM, how long running requests may take to finish
      (new ones get 503 at once; those still running after it get 503).
    - ``build_missing``: build the engines (``build_preset`` or ``build_profiles``, at
      ``build_precision``; by default the family's preset with batch 1 to ``max_batch_size``)
      once before traffic, on a node of the replicas' kind; each ControlNet of
      ``controlnet_dir`` too, with the UNet that takes their residuals.
    - ``address``: the Ray cluster to join (default ``$RAY_ADDRESS``, else a local Ray).
    - ``controlnet_dir``: a folder of ControlNets (single files or diffusers folders) that requests
      name in ``alwayson_scripts.controlnet`` (sd-webui-controlnet's API), by file or folder name.

    >>> ServeConfig(max_batch_size=0)
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: ServeConfig.max_batch_size=0 is not valid; allowed: an integer >= 1
    """

    model: str = "builtin:tiny-sd15"
    allow_pickle: bool = False
    accel: AccelConfig = field(default_factory=lambda: AccelConfig(engines=True))
    engine_dir: str | None = None
    host: str = LOOPBACK
    port: int = 8000
    token: str | None = field(default=None, repr=False)
    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_batch_size: int = 4
    batch_wait_ms: float | None = None
    max_ongoing_requests: int = 8
    max_queued_requests: int = 16
    request_timeout_s: float = 300.0
    retry_after_s: float = 5.0
    build_missing: bool = False
    build_preset: str | None = None
    build_profiles: list[dict[str, Any]] | None = None
    build_precision: str = "auto"
    address: str | None = None
    app_name: str = "sd-accel"
    object_store_mb: int = 256
    max_request_bytes: int = 1 << 20
    shutdown_grace_s: float = 30.0
    controlnet_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.accel, dict):
            try:
                # Serving is for accelerated pipelines: engines on unless the dict turns them off.
                self.accel = AccelConfig(**{"engines": True, **self.accel})
            except TypeError as exc:
                names = ", ".join(f.name for f in dataclasses.fields(AccelConfig))
                raise InvalidValue(f"ServeConfig.accel: {exc}; AccelConfig fields are: {names}") from None
        if not isinstance(self.accel, AccelConfig):
            _bad("accel", self.accel, "an AccelConfig or a dict of its fields")
        if self.engine_dir is not None:
            self.engine_dir = str(Path(self.engine_dir).expanduser().resolve())
            self.accel = dataclasses.replace(self.accel, engine_dir=self.engine_dir)
        elif self.accel.engine_dir is not None:
            self.engine_dir = str(Path(self.accel.engine_dir).expanduser().resolve())
        if self.controlnet_dir is not None:
            folder = Path(str(self.controlnet_dir)).expanduser().resolve()
            if not folder.is_dir():
                _bad("controlnet_dir", self.controlnet_dir, "an existing folder of ControlNet files")
            self.controlnet_dir = str(folder)
        if not isinstance(self.model, str) or not self.model:
            _bad("model", self.model, "a checkpoint file, a diffusers folder or builtin:tiny-sd15")
        for flag in ("allow_pickle", "build_missing"):
            if not isinstance(getattr(self, flag), bool):
                _bad(flag, getattr(self, flag), "True or False")
        if not isinstance(self.host, str) or not self.host:
            _bad("host", self.host, "an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        _int_at_least("port", self.port, 1)
        if self.port > 65535:
            _bad("port", self.port, "1 to 65535")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            _bad("token", "<hidden>", "a non-empty string, or None for no token")
        for name in ("num_replicas", "max_batch_size", "max_ongoing_requests", "max_queued_requests"):
            _int_at_least(name, getattr(self, name), 1)
        _number_at_least("num_cpus", self.num_cpus, 0)
        _number_at_least("num_gpus", self.num_gpus, 0)
        if self.batch_wait_ms is not None:
            _number_at_least("batch_wait_ms", self.batch_wait_ms, 0)
        _number_at_least("request_timeout_s", self.request_timeout_s, 0, strict=True)
        _number_at_least("retry_after_s", self.retry_after_s, 0)
        _int_at_least("object_store_mb", self.object_store_mb, 64)
        _int_at_least("max_request_bytes", self.max_request_bytes, 1024)
        _number_at_least("shutdown_grace_s", self.shutdown_grace_s, 0)
        if self.max_ongoing_requests < self.max_batch_size:
            _bad("max_ongoing_requests", self.max_ongoing_requests,
                 f"at least max_batch_size ({self.max_batch_size}), or batches can never fill")
        if self.build_preset is not None and self.build_profiles is not None:
            raise InvalidValue("ServeConfig: give build_preset or build_profiles, not both")
        if self.build_profiles is not None:
            from sd_accel.profiles import Profile

            if not isinstance(self.build_profiles, list) or not self.build_profiles:
                _bad("build_profiles", self.build_profiles, "a non-empty list of profile dicts")
            for p in self.build_profiles:
                Profile.of(p)  # raises InvalidValue naming the bad field
        if self.build_preset is not None:
            from sd_accel.profiles import preset

            preset(self.build_preset)

    @property
    def open_to_network(self) -> bool:
        """Whether ``host`` listens beyond this machine."""
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host != "localhost"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the accel config as a dict): what the replicas are given."""
        data = dataclasses.asdict(self)
        data["accel"] = self.accel.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeConfig:
        """A config from plain data; unknown keys are an error that lists the known ones."""
        if not isinstance(data, dict):
            raise InvalidValue(f"a serve config must be a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidValue(f"unknown serve config fields {unknown}; known: {', '.join(sorted(known))}")
        return cls(**data)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The fields in a YAML (``.yaml``/``.yml``) or JSON file, as a dict (not yet validated).

    Example file::

        model: ~/models/dreamshaper_8.safetensors
        engine_dir: /shared/engines
        accel: {precision: fp16, sampler: "DPM++ 2M Karras"}
        num_replicas: 2
        max_batch_size: 4
        batch_wait_ms: 30
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidValue(f"serve config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError (not a ValueError)
        raise InvalidValue(f"serve config file {path} cannot be read: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidValue(f"serve config file {path} must hold a mapping of fields, got {type(data).__name__}")
    return data


def make_config(file: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """A config from an optional file, then ``overrides`` (``None`` values leave the file's or
    default value); the token falls back to ``$SD_ACCEL_SERVE_TOKEN``."""
    data = load_config_file(file) if file is not None else {}
    accel_over = overrides.pop("accel", None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    if accel_over:
        base = data.get("accel") or {}
        if isinstance(base, AccelConfig):
            base = base.to_dict()
        data["accel"] = {**base, **{k: v for k, v in accel_over.items() if v is not None}}
    if not data.get("token") and os.environ.get(TOKEN_ENV):
        data["token"] = os.environ[TOKEN_ENV]
    return ServeConfig.from_dict(data)
