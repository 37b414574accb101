"""``EngineKey``: every field that makes an engine unusable elsewhere."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from sd_accel.core import SPEC_VERSION


@dataclass(frozen=True)
class EngineKey:
    """Two equal keys mean two interchangeable engine files.

    >>> EngineKey("0123456789abcdef", "unet", "onnxruntime", "1.32.0", "cpu-x86_64-avx512",
    ...           "fp32", "static.b1.h512.w512.t77").name
    'unet.cpu-x86_64-avx512.fp32.static.b1.h512.w512.t77.onnxruntime-1.32.0.0123456789ab.f7abbc5a.s2'
    """

    model: str  # fingerprint of the component's weights
    component: str  # clip, clip2, unet, vae_decoder, vae_encoder
    backend: str
    backend_version: str
    arch: str  # "sm89" for NVIDIA GPUs, a CPU class for CPU engines
    precision: str  # fp32, fp16, int8
    profile: str  # Profile.tag
    spec_version: int = SPEC_VERSION
    # How the engine is cut: "" for one engine of the whole module; "seg<n>-<digest>" for a chain of
    # n segment engines built one by one (sd_accel.components.segments). Left out of the dict and
    # the name when empty, so the keys of whole engines stay what they were.
    layout: str = ""

    @property
    def name(self) -> str:
        """A readable, file-system-safe name that is unique per key."""
        # The short digest of the whole key keeps names unique even where the readable part is
        # shortened or had unsafe characters replaced.
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
        readable = (
            f"{self.component}.{self.arch}.{self.precision}.{self.profile}."
            f"{self.backend}-{self.backend_version}.{self.model[:12]}"
            + (f".{self.layout}" if self.layout else "")
        )
        readable = re.sub(r"[^A-Za-z0-9._+-]", "_", readable)[:180]
        return f"{readable}.{digest}.s{self.spec_version}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.layout:
            del data["layout"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineKey:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
