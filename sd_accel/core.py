"""The foundation every layer may import: shapes, progress callbacks, component names and errors.

Nothing here imports another sd-accel module (nor torch at run time), so no layer ever has to
import upwards to share a type. Every error the package raises derives from ``SdAccelError``;
each keeps the built-in base callers already catch (``ValueError`` for bad input, ...).

>>> issubclass(InvalidValue, SdAccelError) and issubclass(InvalidValue, ValueError)
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and numpy only for hints: the cache and the CLI import this module cheaply
    import numpy as np
    import torch

# --------------------------------------------------------------------------- shapes and progress

# Bump when the exported graphs change meaning (inputs, outputs, wrapper behaviour):
# engines built from an older export are then never matched.
# 2: attention traced as 4-D MatMul(Q * scale, K^T) -> Softmax -> MatMul (no baddbmm zero bias).
SPEC_VERSION = 2


Shape = tuple[int, ...]
# Per input name: (min, opt, max) shapes. Static engines have min == opt == max.
ShapeRanges = dict[str, tuple[Shape, Shape, Shape]]
# progress(fraction 0..1, message); long work calls it as it goes and stops when it raises.
Progress = Callable[[float, str], None]


def covers(shapes: ShapeRanges, feed: dict[str, torch.Tensor]) -> bool:
    """Whether every input of ``feed`` lies inside the (min, max) ranges, dimension by dimension.

    >>> import torch
    >>> covers({"x": ((1, 4), (1, 8), (2, 8))}, {"x": torch.zeros(2, 6)})
    True
    >>> covers({"x": ((1, 4), (1, 8), (2, 8))}, {"x": torch.zeros(3, 6)})
    False
    """
    if set(feed) != set(shapes):
        return False
    for name, tensor in feed.items():
        lo, _, hi = shapes[name]
        if tensor.dim() != len(lo):
            return False
        if any(not (a <= d <= b) for a, d, b in zip(lo, tensor.shape, hi, strict=True)):
            return False
    return True


def distance(shapes: ShapeRanges, feed: dict[str, torch.Tensor]) -> float:
    """How far a feed is from the opt shapes (relative, summed); the runtime prefers the nearest."""
    total = 0.0
    for name, tensor in feed.items():
        opt = shapes[name][1]
        total += sum(abs(d - o) / max(o, 1) for d, o in zip(tensor.shape, opt, strict=True))
    return total


@dataclass
class CalibrationSet:
    """Real input feeds (name -> fp32/int array) of one component at one shape, for static INT8.

    ``sd_accel.calibration`` captures them from pipeline runs; the backends' quantizers read them.
    """

    component: str
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.feeds)

    def save(self, path: Path, tmp: Path) -> None:
        """Write to ``tmp`` (a name ending in ``.npz``), then rename it to ``path``: a reader never
        sees half a file. The caller names both (sd_accel.paths owns the cache's names)."""
        import numpy as np

        arrays: dict[str, Any] = {f"{i}/{k}": v for i, feed in enumerate(self.feeds) for k, v in feed.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, component: str, path: Path) -> CalibrationSet:
        import numpy as np

        with np.load(path) as data:
            feeds: dict[int, dict[str, np.ndarray]] = {}
            for key in data.files:
                index, name = key.split("/", 1)
                feeds.setdefault(int(index), {})[name] = data[key]
        return cls(component, [feeds[i] for i in sorted(feeds)])


# --------------------------------------------------------------------------- component names

# The one vocabulary of every face (CLI, panel, WebUI, serve). The specs behind the names are in
# sd_accel.components (whose order this is); the names live here so that the CLI and the panels
# read them without importing torch.
COMPONENTS: tuple[str, ...] = ("clip", "clip2", "t5", "unet", "transformer", "vae_decoder", "vae_encoder")
# The pipeline attributes each component may stand in for (the VAE serves two components). ``t5``
# is SD3's ``text_encoder_3`` and FLUX.1's ``text_encoder_2`` (where SDXL and SD3 have CLIP-G, clip2):
# the spec of each tells by the module's class (sd_accel.components.specs_for).
PIPELINE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "clip": ("text_encoder",), "clip2": ("text_encoder_2",), "t5": ("text_encoder_3", "text_encoder_2"),
    "unet": ("unet",), "transformer": ("transformer",), "vae_decoder": ("vae",), "vae_encoder": ("vae",)}
# The first (or only) one of each.
PIPELINE_ATTRIBUTE: dict[str, str] = {c: attrs[0] for c, attrs in PIPELINE_ATTRIBUTES.items()}
# What a face builds when not told: vae_encoder only serves img2img, and leaving it out keeps the
# first build shorter. A face offers the ones its model has (the WebUI's has no clip2; SD 1.x has
# no t5 and no transformer, SD3 and FLUX.1 no unet).
DEFAULT_COMPONENTS: tuple[str, ...] = ("clip", "clip2", "t5", "unet", "transformer", "vae_decoder")
# Names that stand for several components (``--components vae``): the text encoders, the VAE's halves.
COMPONENT_ALIASES: dict[str, tuple[str, ...]] = {
    "clip": ("clip", "clip2"),
    "text": ("clip", "clip2", "t5"),
    "unet": ("unet",),
    "denoiser": ("unet", "transformer"),
    "vae": tuple(c for c, attr in PIPELINE_ATTRIBUTE.items() if attr == "vae"),
}


# --------------------------------------------------------------------------- errors


def peft_layer(module: object) -> bool:
    """Whether ``module`` is a PEFT tuner layer (a LoRA-wrapped Linear/Conv), without importing
    peft (it is optional): they all carry these. Here, not beside the weights code that uses it,
    so that the runtime's per-call freshness check does not import onnx (the WebUI extension
    imports the runtime in WebUIs whose numpy the installed onnx may not load)."""
    return hasattr(module, "merged_adapters") and hasattr(module, "active_adapters") and hasattr(
        module, "get_base_layer")


class SdAccelError(Exception):
    """Base class of every error sd-accel raises. Messages say what was wrong and what to do."""


class InvalidValue(SdAccelError, ValueError):
    """An argument, option or request field with a value sd-accel cannot use."""


class CheckpointError(SdAccelError, ValueError):
    """A model file that cannot be loaded: unknown family, truncated, not a checkpoint, unsafe."""


class UnsupportedComponent(InvalidValue):
    """A pipeline module sd-accel cannot export (an unusual conditioning, an adapter); it runs in torch."""


class DeviceError(SdAccelError, RuntimeError):
    """A device, library or option that cannot run on this machine (no CUDA, no xFormers, ...)."""


class EngineError(SdAccelError, RuntimeError):
    """An engine that cannot be built, loaded or run."""


class EngineFault(EngineError):
    """The engine itself is unusable: a corrupt file, a load or deserialize error, inputs or
    outputs other than its record says. The runtime marks it bad in the cache; any other run-time
    error (out of memory, a refused call) only skips it for that call."""


class ValidationFailed(EngineError):
    """An engine was built but missed its accuracy check against torch; it was not kept."""


class BuildCancelled(EngineError):
    """A build was cancelled; nothing partial was left in the cache."""


class Busy(SdAccelError, RuntimeError):
    """Another build or generation holds the resource; wait, or cancel it."""


class InvalidType(SdAccelError, TypeError):
    """An argument of a type sd-accel cannot use (a config that is not an ``AccelConfig``, ...)."""


class ModelNotFound(CheckpointError, FileNotFoundError):
    """A model source that does not exist: no such file, folder or built-in name."""


class BenchError(SdAccelError, RuntimeError):
    """A benchmark row that failed; the message carries the end of its output."""


class MissingDependency(SdAccelError, ImportError):
    """An optional package a feature needs is not installed; the message names the pip command."""
