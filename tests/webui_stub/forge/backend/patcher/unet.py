"""``backend/patcher/unet.py``: ``UnetPatcher``."""

from backend.patcher.base import ModelPatcher


class UnetPatcher(ModelPatcher):
    pass
