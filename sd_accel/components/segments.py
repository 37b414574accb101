"""A transformer cut into segments, each exported and built on its own (issue 44: build within the
machine).

One ``torch.onnx.export`` of a whole transformer peaks at 1.7-4.7x its fp32 weights plus 1-2 GB
(the design notes' measured facts): FLUX.1 (44 GB of fp32) and SD3.5 Large cannot be exported
that way on a 24 GB machine. Cut into segments (the input embeddings with the first block(s); runs
of blocks; the last block(s) with the final norm and projection), a build holds one segment in
fp32 at a time, and the engine is a chain of segment engines, each fed the one before's outputs
(``sd_accel.backends.chain``).

What a segment passes on: ``hidden`` (the image tokens), ``context`` (the text tokens) and, from
the first segment, ``temb`` (the time / pooled-text embedding every block reads). The family
modules (``flux/segments.py``, ``sd3/segments.py``) say what each segment takes and computes; this
module says where the cuts go (:func:`plan_for`) and wraps a segment as a component spec
(:class:`SegmentSpec`) that the ONNX exporter and the backends take like any other.

A first-block step cache (issue 44, part 4: ``AccelConfig.step_cache``) needs its own cut
(:func:`step_cache_plan`): the embeddings with the first block alone, which also gives that block's
residual (``first_residual``: its image tokens out minus in); the other blocks; and the final norm
and projection alone, so that a step can skip the blocks between (:mod:`sd_accel.runtime.step_cache`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile, Range

SEGMENTS_ENV = "SD_ACCEL_SEGMENTS"
GIB = 1 << 30
# A segment's output of a tensor it also takes (``hidden``, ``context``) is named with this suffix:
# an ONNX graph cannot give an output an input's name (the exporter renames the input).
NEXT = "_next"
# The first block's residual on the image tokens (its output minus its input): what the first
# segment of a step-cache plan also gives, the signal the step cache compares between steps.
FIRST_RESIDUAL = "first_residual"
# The layout tag's prefix of a step-cache plan (``fbc<n>-<digest>``); other plans' is "seg".
STEP_CACHE_KIND = "fbc"


def state_name(output: str) -> str:
    """The name a segment's output goes on under in the chain (``hidden_next`` -> ``hidden``)."""
    return output[: -len(NEXT)] if output.endswith(NEXT) else output


@dataclass(frozen=True)
class SegmentPolicy:
    """When a transformer is built in segments, and how big each is.

    ``auto_above``: segment automatically when the transformer's weights in fp32 pass this many
    bytes (4 GiB: SD3.5 Medium, SD3.5 Large and FLUX.1 are segmented, the real-width slices of one
    block of each kind and every tiny model are not, so their engines keep their keys);
    ``budget``: the fp32 bytes of blocks one segment holds (a block bigger than that is a segment
    of its own: one FLUX.1 double block is 1.4 GB); ``always``: segment whatever the size.
    """

    budget: int = GIB
    auto_above: int = 4 * GIB
    always: bool = False
    never: bool = False

    @classmethod
    def from_env(cls) -> SegmentPolicy:
        """``SD_ACCEL_SEGMENTS``: ``auto`` (the default: above 4 GiB of fp32 weights), ``off``, or
        a budget in MiB per segment (``512``), which segments whatever the size."""
        value = os.environ.get(SEGMENTS_ENV, "auto").strip().lower()
        if value in ("", "auto"):
            return cls()
        if value in ("0", "off", "no", "false"):
            return cls(never=True)
        try:
            mib = float(value)
        except ValueError:
            raise InvalidValue(f"{SEGMENTS_ENV}={value!r}: use 'auto', 'off' or a budget in MiB per segment") from None
        if mib <= 0:
            raise InvalidValue(f"{SEGMENTS_ENV}={value!r}: a budget in MiB must be above 0")
        return cls(budget=int(mib * (1 << 20)), always=True)


@dataclass(frozen=True)
class Segment:
    """One segment: its blocks as (the transformer's block list, index in it), in order;
    ``first`` also embeds the inputs, ``last`` also projects the output."""

    index: int
    blocks: tuple[tuple[str, int], ...]
    first: bool
    last: bool
    # (the first segment of a step-cache plan) also gives its block's residual: FIRST_RESIDUAL
    residual: bool = False

    @property
    def folder(self) -> str:
        """The segment engine's folder inside the chained engine's."""
        return f"seg{self.index:02d}"


@dataclass(frozen=True)
class SegmentPlan:
    segments: tuple[Segment, ...]
    kind: str = "seg"  # STEP_CACHE_KIND: the cut a step cache needs (step_cache_plan)

    @property
    def tag(self) -> str:
        """``seg<n>-<digest>`` (``fbc<n>-<digest>`` for a step-cache plan): the engine key's
        ``layout``. Two plans with the same cuts have the same tag."""
        cuts = ";".join(",".join(f"{name}:{i}" for name, i in s.blocks) for s in self.segments)
        return f"{self.kind}{len(self.segments)}-{hashlib.sha256(cuts.encode()).hexdigest()[:6]}"


def _fp32_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * 4 for t in (*module.parameters(), *module.buffers()) if t.is_floating_point())


def _attr(module: torch.nn.Module, dotted: str):
    for name in dotted.split("."):
        module = getattr(module, name)
    return module


def plan_for(spec, policy: SegmentPolicy | None = None) -> SegmentPlan | None:
    """Where to cut ``spec``'s module (None: build it whole). Only the specs that say their block
    lists (``segment_blocks``: the transformer families' and T5's) can be cut."""
    policy = SegmentPolicy.from_env() if policy is None else policy
    lists = getattr(spec, "segment_blocks", None)
    if policy.never or lists is None:
        return None
    module = spec.torch_module()
    if not policy.always and _fp32_bytes(module) <= policy.auto_above:
        return None
    blocks = [(name, i, _fp32_bytes(block)) for name in lists() for i, block in enumerate(_attr(module, name))]
    groups: list[list[tuple[str, int]]] = []
    size = 0
    for name, i, nbytes in blocks:
        if not groups or size + nbytes > policy.budget:
            groups.append([])
            size = 0
        groups[-1].append((name, i))
        size += nbytes
    if len(groups) < 2:
        return None
    last = len(groups) - 1
    return SegmentPlan(tuple(Segment(k, tuple(g), k == 0, k == last) for k, g in enumerate(groups)))


def is_step_cache_layout(layout: str) -> bool:
    """Whether an engine key's ``layout`` is a step-cache plan's (:func:`step_cache_plan`)."""
    return layout.startswith(STEP_CACHE_KIND)


def step_cache_plan(spec, policy: SegmentPolicy | None = None) -> SegmentPlan | None:
    """The cut a first-block step cache needs (``AccelConfig.step_cache``), whatever the size: the
    embeddings and the first block alone (giving :data:`FIRST_RESIDUAL` too); the other blocks,
    in segments of the policy's ``budget`` where the module would be segmented anyway, else in
    one; the final norm and projection alone. None for a spec that cannot be cut (not a
    transformer family's) or has a single block."""
    policy = SegmentPolicy.from_env() if policy is None else policy
    lists = getattr(spec, "segment_blocks", None)
    if lists is None or getattr(spec, "name", "") != "transformer":  # (T5 is cut too, but steps none)
        return None
    module = spec.torch_module()
    blocks = [(name, i, _fp32_bytes(block)) for name in lists() for i, block in enumerate(_attr(module, name))]
    if len(blocks) < 2:
        return None
    cut = policy.always or _fp32_bytes(module) > policy.auto_above
    groups: list[list[tuple[str, int]]] = [[blocks[0][:2]], []]
    size = 0
    for name, i, nbytes in blocks[1:]:
        if cut and groups[-1] and size + nbytes > policy.budget:
            groups.append([])
            size = 0
        groups[-1].append((name, i))
        size += nbytes
    groups.append([])  # the final norm and projection
    last = len(groups) - 1
    return SegmentPlan(tuple(Segment(k, tuple(g), k == 0, k == last, residual=k == 0) for k, g in enumerate(groups)),
                       kind=STEP_CACHE_KIND)


class SegmentModule(torch.nn.Module):
    """A segment of a transformer: the submodules it runs, shared with the transformer (no copy).

    Exposes its attention layers' processors as diffusers models do, so that the export's and the
    validation's attention settings (``sd_accel.onnx.attention``) reach a segment as they reach the
    whole transformer."""

    @property
    def attn_processors(self) -> dict:
        return {f"{name}.processor": m.get_processor() for name, m in self.named_modules()
                if hasattr(m, "get_processor") and hasattr(m, "set_processor")}

    def set_attn_processor(self, processor) -> None:
        for name, m in self.named_modules():
            if hasattr(m, "get_processor") and hasattr(m, "set_processor"):
                m.set_processor(processor[f"{name}.processor"] if isinstance(processor, dict) else processor)


class SegmentSpec(ComponentSpec):
    """One segment of ``parent`` (a transformer family's spec) as a component spec: what the ONNX
    exporter and the backends build. Its symbols are the parent's, plus those the family adds for
    the tensors between segments (SD3's image token count ``T``)."""

    def __init__(self, parent: ComponentSpec, segment: Segment) -> None:
        super().__init__(parent.pipe)
        self.parent = parent
        self.segment = segment
        self.name = f"{parent.name}.{segment.folder}"
        self._module: torch.nn.Module | None = None
        self._io = parent.segment_io(segment)

    @property
    def attribute(self) -> str:
        return self.parent.attribute

    def torch_module(self) -> torch.nn.Module:
        if self._module is None:
            self._module = self.parent.segment_module(self.segment)
        return self._module

    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._io[0]

    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._io[1]

    def export_module(self) -> torch.nn.Module:
        return self.torch_module()

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        return self.parent.segment_ranges(profile)

    def export_dims(self) -> dict[str, int]:
        return self.parent.segment_dims(self.parent.export_dims())

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The parent's feed for the inputs it has (FLUX.1's positions must be a real grid), ~N(0, 1)
        for the tensors between segments (the trace only needs their shapes)."""
        outer = self.parent.sample_feed({k: v for k, v in dims.items()}, seed=seed, device=device)
        g = torch.Generator("cpu").manual_seed(seed + 7)
        shapes = self.shapes(dims)
        return {t.name: outer[t.name] if t.name in outer else torch.randn(shapes[t.name], generator=g).to(device)
                for t in self.inputs()}


__all__ = ["FIRST_RESIDUAL", "NEXT", "SEGMENTS_ENV", "STEP_CACHE_KIND", "is_step_cache_layout", "step_cache_plan", "Segment", "SegmentModule", "SegmentPlan", "SegmentPolicy", "SegmentSpec", "plan_for", "state_name"]
