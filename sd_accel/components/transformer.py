"""What the transformer families' denoiser specs share (SD3 / SD3.5's MMDiT in
``components/sd3/``, FLUX.1's in ``components/flux/``): the component name and the module."""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec


class TransformerSpec(ComponentSpec):
    """``pipe.transformer``: the family's subclass says its inputs, outputs and export."""

    name = "transformer"
    attribute = "transformer"

    def torch_module(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def _cfg(self):
        return self.pipe.transformer.config
