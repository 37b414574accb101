"""Whether the torch weights an engine stands for are still the weights it was built from.

An engine-backed stand-in keeps serving its calls only while its torch module holds the weights
the engines were built (or last refitted) from. Users change weights after the swap all the time:
``pipe.load_lora_weights`` (PEFT layers injected into the module), ``set_adapters`` and
``cross_attention_kwargs={"scale": s}`` (adapter scales), ``fuse_lora`` / ``unload_lora_weights``,
``load_state_dict``, a parameter replaced or edited in place. An engine that kept running then
would return the image *without* those changes, silently. :class:`WeightsSnapshot` is taken at
the swap (after the weights are parked) and checked on every call, cheaply:

On every call (:meth:`WeightsSnapshot.changed`, cost measured in the report of issue 14: tens
of microseconds on the tiny UNet, a few hundred on SD 1.5's):

- the module tree: each child still the same object under the same parent and name (PEFT
  replaces a ``Linear`` by a LoRA layer at its parent; ``unload`` puts the original back);
- each parameter and buffer: the same object, the same version counter (in-place edits through
  torch: ``load_state_dict``, ``add_``, ``copy_``);
- the state of each PEFT layer present at the snapshot: active adapters, scales, merged and
  disabled flags (``set_adapters``, a LoRA scale, after a refit with a LoRA).

On the first call after the module may have been touched (``full=True``: the stand-in says when:
a pipeline LoRA method ran, or a method or submodule of the torch module was reached through the
stand-in), also:

- each tensor's data pointer (``.data = ...``: PEFT's safe merge);
- a probe of a few values of each floating tensor: PEFT's merge writes ``weight.data += delta``,
  which moves neither the data pointer nor the version counter (``fuse_lora`` then
  ``unload_lora_weights`` leaves the original modules with fused values).

Parking (:mod:`sd_accel.runtime.weights`) moves data pointers without changing a value: the
snapshot is (re)taken after it, so parking never counts as a change. Limits: an edit through
``.data`` by code that holds the torch module itself (not through the pipeline or the stand-in),
or one that leaves every probed value as it was (5 positions per tensor), is not seen.
"""

from __future__ import annotations

import operator

import torch

from sd_accel.core import peft_layer as _peft_layer

_PROBES = 4  # intervals per tensor: probes at 0, n/4, n/2, 3n/4 and the last element

# The reasons a stale call falls back with (one each, so the log says each once).
TREE = "LoRA layers added or removed, or modules replaced"
REPLACED = "parameters replaced"
EDITED = "parameters edited in place"
ADAPTERS = "LoRA adapters, their scales or merged state changed"
VALUES = "parameter values changed (a LoRA fused or unloaded, an edit through .data)"


def adapter_state(layer: torch.nn.Module) -> tuple:
    """What of a PEFT layer's state changes its output without touching a weight."""
    scaling = getattr(layer, "scaling", {}) or {}
    # rounded: a scale applied for one call and taken off again may come back one ulp away
    return (tuple(layer.active_adapters), tuple(sorted((k, round(float(v), 9)) for k, v in scaling.items())),
            bool(getattr(layer, "disable_adapters", False)), tuple(layer.merged_adapters))


def _probe_view(t: torch.Tensor) -> torch.Tensor | None:
    n = t.numel()
    if n == 0 or not t.is_floating_point() or not t.is_contiguous():
        return None
    step = max(1, (n - 1) // _PROBES) if n > 1 else 1
    count = (n - 1) // step + 1
    # a view (shares storage): an edit through .data shows in it
    return t.detach().reshape(-1).as_strided((count,), (step,))


class WeightsSnapshot:
    """The weights of one torch module as the engines know them; :meth:`changed` on every call.

    Parallel lists, checked with ``map``: this runs on every call, and a loop in Python over
    hundreds of parameters costs what the call's engine saves at small sizes.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.link_tables: list[dict] = []  # parent._modules
        self.link_names: list[str] = []
        self.link_children: list[torch.nn.Module] = []
        self.tables: list[dict] = []  # owner._parameters / owner._buffers
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.aliases: list[torch.Tensor] = []  # detached: share the version counter, read faster
        self.versions: list[int] = []
        self.pointers: list[int] = []
        self.adapters: list[tuple[torch.nn.Module, tuple]] = []
        self.probes: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}
        groups: dict[tuple, list[torch.Tensor]] = {}
        for owner in module.modules():
            for name, child in owner._modules.items():
                if child is not None:
                    self.link_tables.append(owner._modules)
                    self.link_names.append(name)
                    self.link_children.append(child)
            for table in (owner._parameters, owner._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    self.tables.append(table)
                    self.names.append(name)
                    self.tensors.append(t)
                    self.aliases.append(t.detach())
                    self.versions.append(t._version)
                    self.pointers.append(t.data_ptr())
                    view = _probe_view(t)
                    if view is not None:
                        groups.setdefault((t.dtype, t.device), []).append(view)
            if _peft_layer(owner):
                self.adapters.append((owner, adapter_state(owner)))
        with torch.no_grad():
            for key, views in groups.items():
                self.probes[key] = (views, torch.cat(views))

    @classmethod
    def take(cls, module: torch.nn.Module) -> WeightsSnapshot:
        return cls(module)

    def changed(self, full: bool = False) -> str | None:
        """Why the module's weights are no longer those of the snapshot (one of this module's
        reason constants), or None. ``full``: also data pointers and probed values (see the
        module doc)."""
        if not all(map(operator.is_, map(dict.get, self.link_tables, self.link_names), self.link_children)):
            return TREE
        if not all(map(operator.is_, map(dict.get, self.tables, self.names), self.tensors)):
            return REPLACED
        if [t._version for t in self.aliases] != self.versions:
            return EDITED
        for layer, state in self.adapters:
            if adapter_state(layer) != state:
                return ADAPTERS
        if not full:
            return None
        if [t.data_ptr() for t in self.tensors] != self.pointers:
            return EDITED
        with torch.no_grad():
            for views, values in self.probes.values():
                if not torch.equal(torch.cat(views), values):
                    return VALUES
        return None

    def has_adapters(self) -> bool:
        return bool(self.adapters)
