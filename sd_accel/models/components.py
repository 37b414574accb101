"""Build a diffusers pipeline's components from a config folder, with fresh (random) weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers

from sd_accel.models.families import load_family_configs, materialize


def _component_class(entry: list[Any]) -> type | None:
    lib, cls = entry
    if lib is None:
        return None
    return getattr(diffusers if lib == "diffusers" else transformers, cls)


def pipeline_from_config_folder(folder: Path, seed: int = 0) -> diffusers.DiffusionPipeline:
    """A pipeline whose models have the folder's configs and weights drawn from ``seed``."""
    index = json.loads((folder / "model_index.json").read_text())
    torch.manual_seed(seed)
    parts: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list):
            continue
        cls = _component_class(entry)
        if cls is None:
            parts[name] = None
        elif name == "scheduler":
            parts[name] = cls.from_pretrained(folder, subfolder=name)
        elif name.startswith("tokenizer"):
            parts[name] = cls.from_pretrained(folder / name)
        elif issubclass(cls, transformers.PreTrainedModel):
            parts[name] = cls(cls.config_class.from_pretrained(folder / name)).eval()
        else:
            parts[name] = cls.from_config(cls.load_config(folder / name)).eval()
    extra = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
    return getattr(diffusers, index["_class_name"])(**parts, **extra)


def random_pipeline(configs: dict[str, dict[str, Any]], seed: int = 0) -> diffusers.DiffusionPipeline:
    """A pipeline built from in-memory configs (see :func:`load_family_configs`)."""
    return pipeline_from_config_folder(materialize(configs), seed=seed)


__all__ = ["load_family_configs", "pipeline_from_config_folder", "random_pipeline"]
