"""``comfy.utils``: the progress bar nodes report to (``PROGRESS_BAR_HOOK`` is the UI's)."""

from __future__ import annotations

PROGRESS_BAR_HOOK = None
UPDATES: list[tuple[int, int]] = []  # the tests read what the bar was told


def set_attr_param(obj, attr, value):
    import torch

    *path, name = attr.split(".")
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, name, torch.nn.Parameter(value, requires_grad=False))


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total = total
        self.current = 0
        self.hook = PROGRESS_BAR_HOOK

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        self.current = min(value, self.total)
        UPDATES.append((self.current, self.total))
        if self.hook is not None:
            self.hook(self.current, self.total, preview)

    def update(self, value):
        self.update_absolute(self.current + value)
