"""Model families sd-accel knows, and the diffusers config folders shipped for each.

The folders under ``configs/`` are the real configs of the reference models (SD 1.5, SD 2.1 768-v,
SD 2.1 base, SDXL base 1.0, SD 3.5 Medium, FLUX.1 dev and schnell). A checkpoint is loaded with its family's folder, refitted to the
shapes the checkpoint actually has (see :mod:`sd_accel.models.fit`), so nothing is downloaded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_accel.core import InvalidValue
from sd_accel.models.tokenizer import write_tokenizer_files
from sd_accel.paths import cache_dir

CONFIG_ROOT = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Family:
    """One model family: its config folder and how people name it."""

    name: str  # folder under configs/
    title: str
    is_xl: bool = False
    # what denoises: "unet" (SD 1.x/2.x/SDXL), or the transformer of "sd3" (SD3 / SD3.5: MMDiT)
    # or "flux" (FLUX.1), whose components live under sd_accel/components/<kind>/
    denoiser: str = "unet"
    # what a face generates with when the user does not say: the model makers' recommended steps
    # and guidance (SD3.5 Medium 28 / 4.5, FLUX.1 dev 28 / 3.5, schnell 4 steps without guidance)
    steps: int = 20
    cfg: float = 7.0

    @property
    def transformer(self) -> bool:
        return self.denoiser != "unet"

    @property
    def config_dir(self) -> Path:
        return CONFIG_ROOT / self.name


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("sd15", "Stable Diffusion 1.x"),
        Family("sd2-v", "Stable Diffusion 2.x (768, v-prediction)"),
        Family("sd2-base", "Stable Diffusion 2.x (512 base, epsilon)"),
        Family("sdxl", "Stable Diffusion XL base", is_xl=True),
        Family("sd3", "Stable Diffusion 3.5 Medium", denoiser="sd3", steps=28, cfg=4.5),
        Family("flux-dev", "FLUX.1 dev", denoiser="flux", steps=28, cfg=3.5),
        Family("flux-schnell", "FLUX.1 schnell", denoiser="flux", steps=4, cfg=0.0),
    )
}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise InvalidValue(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def load_family_configs(family: Family) -> dict[str, dict[str, Any]]:
    """All JSON files of a family's folder, keyed by relative path (``"unet/config.json"``)."""
    out = {}
    for path in sorted(family.config_dir.rglob("*.json")):
        out[path.relative_to(family.config_dir).as_posix()] = json.loads(path.read_text())
    return out


def materialize(configs: dict[str, dict[str, Any]]) -> Path:
    """Write a complete diffusers config folder (configs + CLIP tokenizer files) into the cache.

    The folder name is a hash of the configs, so equal configs share one folder and a changed
    config never reuses a stale one. Returns the folder, ready for ``from_single_file(config=...)``.
    """
    blob = json.dumps(configs, sort_keys=True).encode()
    digest = hashlib.sha256(blob).hexdigest()[:16]
    dest = cache_dir() / "configs" / digest
    if (dest / ".complete").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, cfg in configs.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=2))
        if rel.endswith("tokenizer_config.json"):
            write_tokenizer_files(path.parent)
    (tmp / ".complete").write_text("ok")
    shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        # Another process finished the same folder first; theirs is identical.
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def merged(configs: dict[str, dict[str, Any]], overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A deep copy of ``configs`` with each file's keys updated from ``overrides``."""
    out = copy.deepcopy(configs)
    for rel, upd in overrides.items():
        out.setdefault(rel, {}).update(upd)
    return out
