"""fp8 weights (a ``flux1-schnell-fp8-e4m3fn.safetensors``) kept as they are in the file, on its
memory mapping, with each layer computing in the pipeline's dtype.

Cast to bf16 when loaded, FLUX.1's 11.9B fp8 weights become 24 GB of anonymous memory: over a 24 GB
machine. Kept in fp8 on the file's mapping they cost nothing until used: an engine build converts
one segment at a time (:func:`sd_accel.onnx.export.fp32_on` gives the mapped fp8 back after), and a
torch forward (the fallback, the reference a build checks against) casts one layer's own weights
to the compute dtype just before that layer runs and puts the mapped fp8 back right after: one
layer's bf16 copy at a time. The hook is diffusers' layerwise-casting hook under its own name, so
``model.dtype`` reports the compute dtype (diffusers asks the hook), as with
``enable_layerwise_casting``; unlike that one it never writes a new fp8 copy after a forward (that
would move the weights off the file into anonymous memory, 12 GB for FLUX.1).
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _hook_class():
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    class MappedCastHook(LayerwiseCastingHook):
        """Compute on a cast copy of the module's own fp8 tensors; the stored ones stay put."""

        def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
            super().__init__(storage_dtype, compute_dtype, non_blocking=False)
            self.stored: dict[str, torch.Tensor] = {}

        def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
            return module  # (the base class casts the module to the storage dtype: it already is)

        def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None and t.dtype in FP8:
                    self.stored[name] = t.data
                    t.data = t.data.to(self.compute_dtype)
            return args, kwargs

        def post_forward(self, module: torch.nn.Module, output):
            for name, data in self.stored.items():
                t = module._parameters.get(name)
                t = t if t is not None else module._buffers.get(name)
                if t is not None:
                    t.data = data
            self.stored = {}
            return output

    return MappedCastHook


def compute_in(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Hook every submodule of ``model`` holding fp8 tensors of its own so that it computes in
    ``compute_dtype``; returns how many were hooked. Modules without fp8 tensors are untouched."""
    from diffusers.hooks import HookRegistry

    cls = _hook_class()
    hooked = 0
    for module in model.modules():
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        if not any(t.dtype in FP8 for t in own):
            continue
        storage = next(t.dtype for t in own if t.dtype in FP8)
        HookRegistry.check_if_exists_or_initialize(module).register_hook(cls(storage, compute_dtype),
                                                                         "layerwise_casting")
        hooked += 1
    return hooked


__all__ = ["FP8", "compute_in"]
