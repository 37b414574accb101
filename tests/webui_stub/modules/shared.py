"""``modules/shared.py``: ``opts``, ``cmd_opts``, ``sd_model`` and friends."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from modules import options
from modules.options import OptionInfo  # noqa: F401  (extensions use shared.OptionInfo)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for flag in ("medvram", "medvram-sdxl", "lowvram", "xformers", "no-half", "no-half-vae", "upcast-sampling",
                 "opt-sdp-attention", "opt-sdp-no-mem-attention", "disable-opt-split-attention", "api",
                 "skip-install", "nowebui", "skip-load-model-at-start", "always-cpu"):
        parser.add_argument(f"--{flag}", action="store_true")
    parser.add_argument("--api-auth", type=str, default=None)
    parser.add_argument("--use-cpu", nargs="+", default=[], type=str.lower)
    return parser


cmd_opts = _parser().parse_args([])
parallel_processing_allowed = True
config_filename = os.path.join(tempfile.gettempdir(), f"webui-stub-config-{os.getpid()}.json")

opts = options.Options({
    "sd_model_checkpoint": OptionInfo(None, "Stable Diffusion checkpoint"),
    "sd_unet": OptionInfo("Automatic", "SD Unet"),
    "cross_attention_optimization": OptionInfo("Automatic", "Cross attention optimization"),
    "batch_cond_uncond": OptionInfo(True, "Batch cond/uncond"),
    "pad_cond_uncond": OptionInfo(False, "Pad prompt/negative prompt to be same length"),
    "CLIP_stop_at_last_layers": OptionInfo(1, "Clip skip"),
})
class Shared(sys.modules[__name__].__class__):
    """``modules/shared_items.py``'s ``Shared``: ``shared.sd_model`` is a property that loads the
    selected checkpoint on first read (``sd_models.model_data.get_sd_model()``)."""

    @property
    def sd_model(self):
        import modules.sd_models

        return modules.sd_models.model_data.get_sd_model()

    @sd_model.setter
    def sd_model(self, value):
        import modules.sd_models

        modules.sd_models.model_data.set_sd_model(value)


sys.modules[__name__].__class__ = Shared


def set_cmd_opts(argv: list[str]) -> None:
    """Test helper: parse WebUI command-line flags into ``cmd_opts``."""
    global cmd_opts
    cmd_opts = _parser().parse_args(argv)
