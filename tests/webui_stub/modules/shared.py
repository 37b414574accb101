"""``modules/shared.py``: ``opts``, ``cmd_opts``, ``sd_model`` and friends."""

from __future__ import annotations

import argparse
import os
import tempfile

from modules import options
from modules.options import OptionInfo  # noqa: F401  (extensions use shared.OptionInfo)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for flag in ("medvram", "medvram-sdxl", "lowvram", "xformers", "no-half", "no-half-vae", "upcast-sampling",
                 "opt-sdp-attention", "opt-sdp-no-mem-attention", "disable-opt-split-attention", "api",
                 "skip-install"):
        parser.add_argument(f"--{flag}", action="store_true")
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
})
sd_model = None


def set_cmd_opts(argv: list[str]) -> None:
    """Test helper: parse WebUI command-line flags into ``cmd_opts``."""
    global cmd_opts
    cmd_opts = _parser().parse_args(argv)
