"""Which model family a single-file checkpoint holds, from its key names and tensor shapes."""

from __future__ import annotations

from dataclasses import dataclass

from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import Shapes

UNET = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L_SD1 = "cond_stage_model.transformer."
OPENCLIP_SD2 = "cond_stage_model.model."
XL_TE1 = "conditioner.embedders.0.transformer."
XL_TE2 = "conditioner.embedders.1.model."
XL_REFINER_TE = "conditioner.embedders.0.model."
# LCM-distilled UNets (LCM Dreamshaper, LCM-SDXL ...): the guidance-scale embedding's projection.
# No original-layout name exists; diffusers' conversion to a single file keeps its own.
LCM_COND_PROJ = UNET + "time_embedding.cond_proj.weight"


@dataclass(frozen=True)
class Detected:
    """What a checkpoint holds. ``family`` names a folder under ``models/configs``."""

    family: str
    inpaint: bool
    text_layout: str  # "clip-l", "openclip", "sdxl"
    guidance_embedded: bool = False  # an LCM-distilled UNet (time_cond_proj_dim, no CFG batch)

    @property
    def is_xl(self) -> bool:
        return self.family == "sdxl"


def _has_prefix(shapes: Shapes, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in shapes)


def _describe_foreign(shapes: Shapes) -> str:
    """A guess at what a non-checkpoint file is, so the error can name it."""
    keys = list(shapes)
    joined = " ".join(keys[:2000])
    if "lora_unet_" in joined or "lora_te" in joined or ".lora_down." in joined or ".lora_A." in joined:
        return "a LoRA (load it on top of a base checkpoint, not as a model)"
    if "string_to_param" in joined or "emb_params" in joined or set(keys) <= {"clip_l", "clip_g"}:
        return "a textual-inversion embedding"
    if "control_model." in joined or "zero_convs" in joined or "controlnet_cond_embedding" in joined:
        return "a ControlNet (load it with sd_accel.load_controlnet(path), CLI: --controlnet PATH)"
    if any(k.startswith(("encoder.down", "decoder.up")) for k in keys) and "quant_conv.weight" in shapes:
        return "a standalone VAE (original layout)"
    if "conv_in.weight" in shapes and any(k.startswith("down_blocks.") for k in keys):
        return "a diffusers-format component weights file (load its whole diffusers folder instead)"
    return "not a Stable Diffusion checkpoint"


def detect(shapes: Shapes, name: str = "checkpoint") -> Detected:
    """Detect the family of a checkpoint in the original (LDM/SGM) key layout, and whether its UNet
    is LCM-distilled (a guidance embedding, ``time_embedding.cond_proj``).

    (Skipped in the test suite: it needs a real checkpoint file, which nothing here ships;
    tests/test_loading.py and tests/test_lcm.py write tiny ones.)

    >>> detect(read_shapes(Path("LCM_Dreamshaper_v7.safetensors"))).guidance_embedded  # doctest: +SKIP
    True
    """
    from dataclasses import replace

    return replace(_detect(shapes, name), guidance_embedded=LCM_COND_PROJ in shapes)


def _detect(shapes: Shapes, name: str) -> Detected:
    """Detect the family of a checkpoint in the original (LDM/SGM) key layout.

    (Skipped in the test suite: it needs a real checkpoint file, which nothing here ships;
    tests/test_loading.py writes tiny ones in the original layout.)

    >>> detect(read_shapes(Path("v1-5-pruned-emaonly.safetensors")))  # doctest: +SKIP
    Detected(family='sd15', inpaint=False, text_layout='clip-l')
    """
    if not shapes:
        raise CheckpointError(f"{name} holds no tensors")
    if not _has_prefix(shapes, UNET):
        what = _describe_foreign(shapes)
        sample = ", ".join(list(shapes)[:3])
        raise CheckpointError(
            f"{name} has no Stable Diffusion UNet ({UNET}*): it looks like {what}. "
            f"First keys: {sample}. Pass a full SD 1.x, SD 2.x or SDXL checkpoint."
        )
    conv_in = shapes.get(UNET + "input_blocks.0.0.weight")
    if conv_in is None or len(conv_in) != 4:
        raise CheckpointError(f"{name}: UNet input conv {UNET}input_blocks.0.0.weight missing or malformed")
    in_ch = conv_in[1]
    if in_ch not in (4, 9):
        raise CheckpointError(
            f"{name}: UNet takes {in_ch} input channels; sd-accel knows 4 (txt2img) and 9 (inpaint). "
            "Instruct-pix2pix (8) and depth (5) models are not supported."
        )
    inpaint = in_ch == 9
    if not _has_prefix(shapes, VAE):
        raise CheckpointError(
            f"{name} has a UNet but no VAE weights ({VAE}*). Use a checkpoint with its VAE baked in."
        )
    if _has_prefix(shapes, XL_TE2) and _has_prefix(shapes, XL_TE1):
        return Detected("sdxl", inpaint, "sdxl")
    if _has_prefix(shapes, XL_REFINER_TE):
        raise CheckpointError(f"{name} is an SDXL refiner; only SDXL base checkpoints are supported so far.")
    if _has_prefix(shapes, OPENCLIP_SD2):
        return Detected("sd2-v", inpaint, "openclip")
    if _has_prefix(shapes, CLIP_L_SD1):
        return Detected("sd15", inpaint, "clip-l")
    ctx = next((s for k, s in shapes.items() if k.endswith("attn2.to_k.weight")), None)
    hint = f" (its cross-attention width is {ctx[-1]})" if ctx else ""
    raise CheckpointError(
        f"{name} has a UNet and VAE but no text encoder weights that sd-accel recognises{hint}: "
        "expected cond_stage_model.* (SD 1.x/2.x) or conditioner.embedders.* (SDXL)."
    )
