"""The tensors of a safetensors file as views on the file's own memory mapping.

``safe_open(...).get_tensor`` copies every tensor into anonymous memory: a 24 GB FLUX.1 file read
that way is 24 GB of RSS for as long as the model lives, over a 24 GB machine. Tensors made here
share the file's pages instead (a private, copy-on-write mapping: writing one, a LoRA merged in
place, copies only the pages written and never touches the file), so the kernel pages them in
when a layer runs and :func:`sd_accel.pages.release_file` / ``runtime.weights.release`` can hand
them back; :func:`sd_accel.onnx.export.fp32_on` gives such weights their mapped data back after a
segment's export instead of keeping a converted copy.

Example::

    with open_mapped(path) as tensors:
        weight = tensors["img_in.weight"]   # a bf16 view on the file, no copy
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import CheckpointError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class MappedFile:
    """A safetensors file's header and mapping; ``self[key]`` is a tensor on the mapping.

    The mapping lives as long as any tensor made from it (their storages hold it), so closing
    this object (or leaving its ``with`` block) never invalidates a weight a model holds."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                size = self.path.stat().st_size
                head = fh.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path.name} is not a safetensors file (only {size} bytes)")
                (length,) = struct.unpack("<Q", head)
                if length > size - 8 or length > 100 * 2**20:
                    raise CheckpointError(f"{self.path.name} is not a safetensors file (its header length {length} "
                                          f"does not fit the file's {size} bytes): it may be truncated or another format")
                header = json.loads(fh.read(length))
                # ACCESS_COPY: writable for torch (frombuffer warns on read-only buffers) but never
                # written back; untouched pages stay the file's and can be dropped and read again.
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.path.name} could not be read as a safetensors file "
                                  f"({type(exc).__name__}: {exc})") from exc
        self._base = 8 + length
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict] = header
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        if self._base + end > size:
            raise CheckpointError(f"{self.path.name} is truncated: its header describes {self._base + end} bytes, "
                                  f"the file has {size}; download it again")

    def keys(self) -> list[str]:
        return list(self.header)

    def __contains__(self, key: str) -> bool:
        return key in self.header

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path.name}: {key} is stored as {entry['dtype']}, which sd-accel does not read")
        begin, end = (int(x) for x in entry["data_offsets"])
        shape = [int(x) for x in entry["shape"]]
        count = (end - begin) // dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is writable (copy-on-write)
            flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._base + begin)
        return flat.view(shape)

    def close(self) -> None:
        """Drop this object's reference; tensors already made keep the mapping alive."""
        self._map = None  # type: ignore[assignment]

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_mapped(path: Path | str) -> MappedFile:
    """The file ``path`` mapped; see :class:`MappedFile`."""
    return MappedFile(path)


def file_dtype(path: Path | str, key: str) -> torch.dtype:
    """The dtype ``key`` is stored in, in the safetensors file ``path`` (its header only)."""
    with open_mapped(path) as f:
        name = f.header[key]["dtype"]
    if name not in _DTYPES:
        raise CheckpointError(f"{Path(path).name}: {key} is stored as {name}, which sd-accel does not read")
    return _DTYPES[name]


def default_dtype(stored: torch.dtype) -> torch.dtype:
    """The pipeline dtype a transformer file stored in ``stored`` loads in when none is asked:
    float32 for a float32 file, bf16 for anything narrower (a bf16 FLUX.1 in float32 is 48 GB, and
    its T5 built in float32 19 GB)."""
    return torch.float32 if stored in (torch.float32, torch.float64) else torch.bfloat16


def swap_scale_shift(tensor: torch.Tensor) -> torch.Tensor:
    """A final modulation's (shift, scale) halves as diffusers' ``AdaLayerNormContinuous`` takes
    them, scale first (both families' original layouts store shift first). A copy, not a view."""
    shift, scale = tensor.chunk(2, dim=0)
    return torch.cat([scale, shift])


Rename = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def model_on_file(cls, config: dict[str, Any], path: Path, prefix: str, rename: Rename, dtype: torch.dtype,
                  what: str) -> torch.nn.Module:
    """``cls`` (a diffusers model class) built from ``config`` on the meta device, its weights the
    file's tensors under ``prefix`` as ``rename(name, tensor)`` names them (views: a fused q/k/v
    split by ``chunk`` stays on the mapping), left on the file's mapping: a tensor already in
    ``dtype`` costs no memory of its own until used (FLUX.1's 24 GB would not fit a 24 GB machine
    copied); fp8 and 16-bit tensors in a pipeline of another dtype stay as stored there too, each
    layer computing in ``dtype`` (:mod:`sd_accel.models.stored_dtype`); float32 ones in a 16-bit
    pipeline are cast one by one. Every weight the
    architecture has must come from the file (``what`` names it in the error)."""
    from sd_accel.models.stored_dtype import compute_in, kept

    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    state: dict[str, torch.Tensor] = {}
    with open_mapped(path) as f:
        for key in f.keys():
            if key.startswith(prefix):
                for name, tensor in rename(key[len(prefix):], f[key]):
                    state[name] = tensor if kept(tensor.dtype, dtype) else tensor.to(dtype)
    expected = set(model.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(f"{path.name}: {what}'s weights do not match its architecture (missing {missing[:3]}, "
                              f"unexpected {extra[:3]}); it may be truncated or another variant")
    model.load_state_dict(state, assign=True)
    compute_in(model, dtype)
    return model.eval()


__all__ = ["MappedFile", "default_dtype", "file_dtype", "model_on_file", "open_mapped", "swap_scale_shift"]
