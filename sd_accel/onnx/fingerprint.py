"""A fingerprint of a module's weights: what artifacts and engines are keyed by.

The hash covers the module's class, its architecture config (diffusers/transformers ``config``,
minus private and dtype keys: the same weights under another head count are another function),
and every ``state_dict`` entry: name, shape, and values viewed as float32 (integer buffers as they
are). So the same weights give the same fingerprint in fp32, fp16-loaded-from-fp16 or bf16 copies
alike, on any device, whatever file they came from.

**Caching rule.** The result is cached on the module together with a cheap signature: per tensor
its name, shape, dtype, device, storage address and autograd version counter. In-place updates
through torch ops (``param.copy_``, ``load_state_dict``, LoRA fusing, ``module.to``) change the
signature, so the next call hashes again. Writes that bypass the version counter (through
``tensor.data``, or a NumPy view of the storage, or any in-place edit of an inference tensor,
which has no counter) are NOT seen: call :func:`clear_fingerprint` after them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

from sd_accel.core import InvalidValue
from sd_accel.pages import PageDropper, mostly_resident

_ATTR = "_sd_accel_fingerprint"
_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per update: bounded extra memory on any device
# Config keys that say nothing about the function the weights compute.
_CONFIG_IGNORED = {"dtype", "torch_dtype", "transformers_version", "architectures", "name_or_path"}


def fingerprint(module: torch.nn.Module, each: Callable[[torch.Tensor], Any] | None = None,
                hand_back: bool = True) -> str:
    """Hex SHA-256 of ``module``'s weights and architecture (see the module docstring for the rule).

    ``each(tensor)`` runs after each tensor is hashed. With ``hand_back`` (the default) a weight
    memory-mapped from its file that was not in memory before it was hashed has its pages handed
    back right after (:class:`sd_accel.pages.PageDropper`): hashing reads every weight once, and
    FLUX.1's 24 GB mapped from its file stayed resident after it (a 17.7 GiB peak before a build
    began). Weights already in memory (in use) stay; anonymous memory is never touched."""
    tensors = module.state_dict(keep_vars=True)
    signature = _signature(tensors)
    cached = getattr(module, _ATTR, None)
    if cached is not None and cached[0] == signature:
        return cached[1]
    dropper = PageDropper() if hand_back else None
    digest = hashlib.sha256()
    digest.update(type(module).__name__.encode())
    digest.update(_config_blob(module))
    for name, tensor in tensors.items():
        # .data, not .detach(): a view that shares no version counter (a tensor left without one,
        # see _version, raises on any view that shares it)
        cold = dropper is not None and dropper.mapped(tensor) and not mostly_resident(tensor)
        _update(digest, name, tensor.data)
        if cold:
            dropper(tensor)
        if each is not None:
            each(tensor)
    value = digest.hexdigest()
    # object.__setattr__: nn.Module's __setattr__ would be fine too, but this keeps it off any hooks.
    object.__setattr__(module, _ATTR, (signature, value))
    return value


def cached_fingerprint(module: torch.nn.Module) -> str | None:
    """The fingerprint cached on ``module`` if its tensors are still the ones it was computed
    on (cheap: no hashing), else None."""
    cached = getattr(module, _ATTR, None)
    if cached is not None and cached[0] == _signature(module.state_dict(keep_vars=True)):
        return cached[1]
    return None


def remember_fingerprint(module: torch.nn.Module, value: str) -> None:
    """Record ``value`` as the fingerprint of ``module``'s tensors as they are now: for code that
    moved the weights without changing a value (``sd_accel.runtime.weights.park``)."""
    object.__setattr__(module, _ATTR, (_signature(module.state_dict(keep_vars=True)), value))


def clear_fingerprint(module: torch.nn.Module) -> None:
    """Forget the cached fingerprint (after editing weights in a way the version counter misses)."""
    if _ATTR in module.__dict__:
        object.__delattr__(module, _ATTR)


def _signature(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple(
        (name, tuple(t.shape), t.dtype, t.device, t.data_ptr() if t.device.type != "meta" else 0, _version(t))
        for name, t in tensors.items()
    )


def _version(t: torch.Tensor) -> int:
    """The autograd version counter; -1 for inference tensors (made under ``torch.inference_mode``,
    as Forge loads its weights), which have none: their in-place edits are not seen (see
    :func:`clear_fingerprint`), new tensors are (another storage address)."""
    if t.is_inference():
        return -1
    try:
        return t._version
    except RuntimeError:  # an inference tensor given ``.data`` outside inference mode: no counter either
        return -1


def _config_blob(module: torch.nn.Module) -> bytes:
    config = getattr(module, "config", None)
    if config is None:
        return b""
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {k: v for k, v in items.items() if not k.startswith("_") and k not in _CONFIG_IGNORED}
    return json.dumps(kept, sort_keys=True, default=_json_default).encode()


def _json_default(value: Any) -> str:
    return repr(value)


def _update(digest, name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise InvalidValue(
            f"weight {name!r} is on the meta device (sequential CPU offload or lazy loading); "
            "fingerprint the module before offloading it"
        )
    as_float = tensor.is_floating_point()
    digest.update(f"{name}|{tuple(tensor.shape)}|{'f' if as_float else tensor.dtype}\n".encode())
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        part = flat[start : start + _CHUNK_ELEMENTS]
        part = part.to("cpu", torch.float32) if as_float else part.to("cpu")
        if part.dtype == torch.bool:
            part = part.to(torch.uint8)
        digest.update(memoryview(part.contiguous().numpy()).cast("B"))
