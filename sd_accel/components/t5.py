"""T5's encoder (``T5EncoderModel``): SD3 / SD3.5's ``text_encoder_3``, FLUX.1's ``text_encoder_2``.

Engine input: ``input_ids`` (B, L) int32. Engine output: ``last_hidden_state`` (B, L, D), what
both pipelines read (``text_encoder(ids)[0]``). ``L`` is the profile's ``text`` range (the
pipelines' ``max_sequence_length``: SD3 256 by default, FLUX.1 512, up to 512): T5's relative
position buckets make any length one graph, so one dynamic engine serves every length in range.

T5 runs once per prompt (not per step); on a CPU its engine is for memory as much as for speed
(the real encoder is 4.8B parameters).
"""

from __future__ import annotations

import torch

from sd_accel.components import t5_segments as segments
from sd_accel.components.segments import Segment
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile, Range

# The pipelines' ``max_sequence_length`` when the profile does not say (their own defaults).
DEFAULT_TEXT: dict[str, int] = {"StableDiffusion3": 256, "Flux": 512}
MAX_TEXT = 512


def is_t5(module) -> bool:
    """A transformers T5 encoder (the class, not the attribute, tells: FLUX.1's ``text_encoder_2``
    is T5 where SDXL's and SD3's is CLIP)."""
    return type(getattr(module, "torch_module", module)).__name__.startswith("T5")


def default_text_length(pipe) -> int:
    """The pipeline's own ``max_sequence_length`` default (SD3 256, FLUX.1 512)."""
    name = type(pipe).__name__
    return next((n for prefix, n in DEFAULT_TEXT.items() if name.startswith(prefix)), 256)


def text_range(pipe, profile: Profile) -> Range:
    """T5's sequence length range for a profile: its ``text``, else the pipeline's default."""
    if profile.text is not None:
        if profile.text[2] > MAX_TEXT:
            raise InvalidValue(f"Profile.text up to {MAX_TEXT} tokens (the pipelines' max_sequence_length limit), "
                               f"got {profile.text}")
        return profile.text
    n = default_text_length(pipe)
    return (n, n, n)


class _T5Export(torch.nn.Module):
    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.encoder(input_ids, return_dict=True).last_hidden_state,)


class T5Spec(ComponentSpec):
    """``pipe.text_encoder_3`` (SD3) or ``pipe.text_encoder_2`` (FLUX.1): a ``T5EncoderModel``."""

    name = "t5"

    @property
    def attribute(self) -> str:
        for attr in ("text_encoder_3", "text_encoder_2"):
            if is_t5(getattr(self.pipe, attr, None)):
                return attr
        raise InvalidValue("the pipeline has no T5 encoder; the 't5' component does not apply")

    def torch_module(self) -> torch.nn.Module:
        return getattr(self.pipe, self.attribute)

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("input_ids", ("B", "L"), torch.int32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        width = int(self.torch_module().config.d_model)
        return (TensorSpec("last_hidden_state", ("B", "L", width), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _T5Export(self.torch_module())

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        _, opt, hi = profile.batch  # prompt and negative prompt are encoded in calls of their own
        return {"B": (1, opt, hi), "L": text_range(self.pipe, profile)}

    def export_dims(self) -> dict[str, int]:
        return {"B": 2, "L": 19}

    def int_high(self, name: str) -> int:
        return int(self.torch_module().config.vocab_size)

    # ---- segments (sd_accel.components.segments: a build that holds one segment at a time) ----

    def segment_blocks(self) -> tuple[str, ...]:
        return segments.BLOCK_LISTS

    def segment_io(self, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return segments.segment_io(self, segment)

    def segment_module(self, segment: Segment) -> torch.nn.Module:
        return segments.T5Segment(self.torch_module(), segment)

    def segment_ranges(self, profile: Profile) -> dict[str, Range]:
        return self.dim_ranges(profile)

    def segment_dims(self, dims: dict[str, int]) -> dict[str, int]:
        return dict(dims)
