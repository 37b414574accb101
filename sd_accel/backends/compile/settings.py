"""What the compiled backend's builder and runner share: its settings, the precisions' dtypes, and
the live module a runner runs (handed over by ``CompileBackend.attach``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sd_accel.core import InvalidValue

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CompileSettings:
    """How a component is compiled. The defaults are what pays (see docs/guides/gpu-compile.md):

    ``mode``: Inductor's mode. ``"default"`` on both devices: ``"max-autotune-no-cudagraphs"``
    autotunes GEMMs for minutes per shape for a few percent; ``"reduce-overhead"`` would add
    Inductor's own CUDA graphs, which :class:`~sd_accel.backends.compile.graphs.GraphBook` does
    here with the profile's bookkeeping and the weight-address check. ``cuda_graphs``: capture
    one graph per shape on CUDA (never on a CPU: there are none). ``channels_last``: convolution
    weights in NHWC on CUDA (Tensor Cores' layout; on CPUs Inductor picks layouts itself).
    ``fullgraph``: a graph break is an error at build (the call then runs torch, with the reason)
    rather than a silent split into eager pieces. Fused QKV projections are left off on purpose:
    diffusers' ``fuse_qkv_projections`` copies the weights into new ones, which a LoRA loaded
    later would not reach (stale), and Inductor already fuses the bias and activation work.
    """

    mode: str = "default"
    cuda_graphs: bool = True
    max_graphs: int = 8
    channels_last: bool = True
    fullgraph: bool = True
    # torch.compile's backend: "inductor"; "aot_eager" / "eager" trace without generating code (a
    # quick check of the plumbing, e.g. the GPU script's --dry-run; no speed-up)
    compiler: str = "inductor"

    @classmethod
    def from_env(cls) -> CompileSettings:
        """``SD_ACCEL_COMPILE_MODE`` / ``SD_ACCEL_COMPILE_GRAPHS=0`` override the defaults (the GPU
        script and users try modes without code)."""
        mode = os.environ.get("SD_ACCEL_COMPILE_MODE", cls.mode)
        modes = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
        if mode not in modes:
            raise InvalidValue(f"SD_ACCEL_COMPILE_MODE={mode!r}: use one of {', '.join(modes)}")
        graphs = os.environ.get("SD_ACCEL_COMPILE_GRAPHS", "1") not in ("0", "false", "no")
        compiler = os.environ.get("SD_ACCEL_COMPILE_BACKEND", cls.compiler)
        if compiler not in ("inductor", "aot_eager", "eager"):
            raise InvalidValue(f"SD_ACCEL_COMPILE_BACKEND={compiler!r}: use inductor (the default), aot_eager or eager")
        return cls(mode=mode, cuda_graphs=graphs, compiler=compiler)


@dataclass
class Attached:
    export: torch.nn.Module  # the spec's export wrapper around the live module
    module: torch.nn.Module  # the pipeline's module (weights, dtype, device)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]  # the spec's input dtypes (ints stay ints)
