"""Reading single-file checkpoints safely: keys and shapes without loading weights, and refusing
pickle files unless the caller opts in (a pickle can run arbitrary code when loaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from sd_accel.core import CheckpointError

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")

Shapes = dict[str, tuple[int, ...]]


def read_shapes(path: Path) -> Shapes:
    """Every tensor's name and shape from a ``.safetensors`` header (no weights are read)."""
    from safetensors import safe_open

    size = path.stat().st_size
    if size < 16:
        raise CheckpointError(f"{path} is {size} bytes: too small to be a checkpoint (truncated download?)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError types
        raise CheckpointError(
            f"{path} is not a readable .safetensors file ({exc}). It may be truncated or corrupt: "
            "download it again and compare its size or hash with the source."
        ) from exc


def load_pickle_state_dict(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The state dict of a ``.ckpt``-style pickle file, only when the caller has opted in."""
    if not allow_pickle:
        raise CheckpointError(
            f"{path.name} is a pickle checkpoint ({path.suffix}); loading one can run code hidden in it. "
            "Prefer a .safetensors version of the model. If you trust this file, pass allow_pickle=True "
            "(CLI: --allow-pickle)."
        )
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path} could not be unpickled ({exc}); it may be truncated or corrupt") from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
    return obj
