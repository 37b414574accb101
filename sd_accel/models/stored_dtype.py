"""Weights kept in the dtype their file stores them in (fp8 in a
``flux1-schnell-fp8-e4m3fn.safetensors``, bf16 or fp16 in a float32 or other 16-bit pipeline), on
the file's memory mapping, with each layer computing in the pipeline's dtype.

Cast when loaded, FLUX.1's 11.9B fp8 weights become 24 GB of bf16 in anonymous memory (its bf16
file in a float32 pipeline: 48 GB): over a 24 GB machine. Kept as stored, on the file's mapping,
they cost nothing until used: an engine build converts one segment at a time
(:func:`sd_accel.onnx.export.fp32_on` gives the mapped weights back after), and a torch forward
(the fallback, the reference a build checks against) casts one layer's own weights (one block's,
for the classes named in ``blocks``) to the compute dtype just before it runs and puts the mapped
ones back right after: one layer's copy at a time. The hook is diffusers' layerwise-casting hook under its own name, so
``model.dtype`` reports the compute dtype (diffusers asks the hook), as with
``enable_layerwise_casting``; unlike that one it never writes a new fp8 copy after a forward (that
would move the weights off the file into anonymous memory, 12 GB for FLUX.1).
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NARROW = (*FP8, torch.float16, torch.bfloat16)


def kept(stored: torch.dtype, compute: torch.dtype) -> bool:
    """Whether a weight stored as ``stored`` stays so in a pipeline computing in ``compute``:
    fp8 always, a 16-bit float when the pipeline's dtype is another float (never an up-cast or a
    cross-cast copy at load; a float32 file in a 16-bit pipeline is cast, which halves it)."""
    return stored != compute and stored in _NARROW and compute.is_floating_point


def _hook_class():
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    class MappedCastHook(LayerwiseCastingHook):
        """Compute on a cast copy of the module's own stored tensors; the stored ones stay put."""

        def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, recurse: bool) -> None:
            super().__init__(storage_dtype, compute_dtype, non_blocking=False)
            self.recurse = recurse
            self.stored: list[tuple[torch.Tensor, torch.Tensor]] = []

        def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
            return module  # (the base class casts the module to the storage dtype: it already is)

        def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
            for t in (*module.parameters(recurse=self.recurse), *module.buffers(recurse=self.recurse)):
                if t.dtype != self.compute_dtype and t.dtype in _NARROW:
                    self.stored.append((t, t.data))
                    t.data = t.data.to(self.compute_dtype)
            return args, kwargs

        def post_forward(self, module: torch.nn.Module, output):
            for t, data in self.stored:
                t.data = data
            self.stored = []
            return output

    return MappedCastHook


def compute_in(model: torch.nn.Module, compute_dtype: torch.dtype, blocks: tuple[str, ...] = ()) -> int:
    """Hook the submodules of ``model`` holding tensors kept in their stored dtype (:func:`kept`)
    so that they compute in ``compute_dtype``; returns how many were hooked. A module whose class
    is named in ``blocks`` is hooked as a whole (every tensor under it cast for its forward: T5's
    feed-forward converts its input to ``wo.weight``'s dtype before ``wo`` runs, so a per-layer
    hook would see fp8 activations); any other module with kept tensors of its own, alone.
    Modules without kept tensors are untouched."""
    from diffusers.hooks import HookRegistry

    cls = _hook_class()
    hooked = 0
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered:
            continue
        whole = type(module).__name__ in blocks
        if whole:
            covered.update(id(m) for m in module.modules())
        own = [*module.parameters(recurse=whole), *module.buffers(recurse=whole)]
        stored = [t.dtype for t in own if kept(t.dtype, compute_dtype)]
        if not stored:
            continue
        HookRegistry.check_if_exists_or_initialize(module).register_hook(cls(stored[0], compute_dtype, whole),
                                                                         "layerwise_casting")
        hooked += 1
    return hooked


__all__ = ["FP8", "compute_in", "kept"]
