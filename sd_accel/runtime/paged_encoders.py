"""Big text encoders kept out of resident memory between prompts (SD3.5's and FLUX.1's T5-XXL).

T5-XXL is 9.5 GB in bf16 (4.8 GB as an fp8 file, whose weights now stay fp8 on the file's
mapping: ``models.text_files.fill(keep_fp8=True)``), runs once per prompt, and sat resident beside
the transformer for the whole generation, and beside a transformer's build (which peaked at
20.3 GiB for SD3.5 Medium on a 24 GB machine with it held). Paged, its weights live in a file
mapping (:func:`sd_accel.runtime.weights.park`: memory-mapped files stay where they are,
anonymous weights, a 16-bit file's cast, go to a spill file once) and each layer (each block,
where a block computes on cast copies of its fp8 weights) hands its pages back right after its
forward: a prompt's encoding holds about one block at a time and reads the weights from
disk again (what it costs is measured in ``scripts/BENCHMARKS-full-size.md``). Values never
change: the encoder computes exactly what it did.

``SD_ACCEL_PAGED_ENCODERS``: ``auto`` (default) pages a text encoder of the pipeline whose weights
reach 2 GiB (T5-XXL; not the CLIPs); a number of GiB sets that threshold; ``off`` pages none.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from sd_accel.core import InvalidValue
from sd_accel.runtime.weights import PageDropper, hand_back_hooks, park

log = logging.getLogger("sd_accel")

PAGED_ENV = "SD_ACCEL_PAGED_ENCODERS"
DEFAULT_THRESHOLD = 2 << 30
_HOOKS = "_sd_accel_page_hooks"


def threshold() -> int | None:
    """Bytes from which a text encoder is paged (None: ``off``), from :data:`PAGED_ENV`."""
    value = os.environ.get(PAGED_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return DEFAULT_THRESHOLD
    if value == "off":
        return None
    try:
        return int(float(value) * 2**30)
    except ValueError:
        raise InvalidValue(f"{PAGED_ENV}={value!r}: use auto, off or a size in GiB") from None


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def page_after_use(module: torch.nn.Module) -> None:
    """Each submodule of ``module`` hands back its own file-backed pages right after its forward
    (permanently; once per module)."""
    if getattr(module, _HOOKS, None):
        return
    object.__setattr__(module, _HOOKS, hand_back_hooks(module, PageDropper()))


def page_big_encoders(pipe, folder: Path | str) -> list[str]:
    """Page the pipeline's text encoders in torch whose weights reach :func:`threshold` (see the
    module docstring); ``folder``: where a spill file may go (the engine cache). Returns the
    components paged. Encoders on an engine (their stand-in holds the torch module, parked by
    the swap already), on a GPU, or too small are left alone."""
    limit = threshold()
    components = getattr(pipe, "components", None)
    if limit is None or not isinstance(components, dict):
        return []
    done = []
    for name, module in components.items():
        if not name.startswith("text_encoder") or not isinstance(module, torch.nn.Module):
            continue
        if hasattr(module, "torch_module") or _bytes(module) < limit:
            continue
        if any(p.device.type != "cpu" for p in module.parameters()):
            continue
        if park(module, folder, name) is None:
            continue  # (park logged why: too little disk for the spill file, offload hooks...)
        page_after_use(module)
        done.append(name)
    if done:
        log.info("%s paged: their weights load from disk while they run, one layer at a time (%s=off keeps "
                 "them resident)", ", ".join(done), PAGED_ENV)
    return done


__all__ = ["DEFAULT_THRESHOLD", "PAGED_ENV", "page_after_use", "page_big_encoders", "threshold"]
