"""``backend/operations.py``: ``ForgeOperations.Linear`` is a plain ``nn.Module`` (not an
``nn.Linear``) with ``in_features`` / ``out_features`` and ``weight`` / ``bias`` parameters that
Forge loads under ``torch.inference_mode()`` (inference tensors: no version counter)."""

from __future__ import annotations

import torch


class ForgeOperations:
    class Linear(torch.nn.Module):
        def __init__(self, in_features, out_features, *args, **kwargs):
            super().__init__()
            self.in_features = in_features
            self.out_features = out_features
            self.weight = None
            self.bias = None

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias)


def forge_linears(module: torch.nn.Module) -> None:
    """Every ``nn.Linear`` under ``module`` replaced by a ``ForgeOperations.Linear`` holding the
    same weights as inference tensors, as Forge's loader leaves them."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            new = ForgeOperations.Linear(child.in_features, child.out_features)
            with torch.inference_mode():
                new.weight = torch.nn.Parameter(child.weight.detach().clone(), requires_grad=False)
                if child.bias is not None:
                    new.bias = torch.nn.Parameter(child.bias.detach().clone(), requires_grad=False)
            setattr(module, name, new)
        else:
            forge_linears(child)
