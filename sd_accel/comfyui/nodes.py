"""The pack's nodes, as ComfyUI reads them: ``INPUT_TYPES``, ``RETURN_TYPES``, ``FUNCTION``,
``CATEGORY``, collected in :data:`NODE_CLASS_MAPPINGS` / :data:`NODE_DISPLAY_NAME_MAPPINGS`.

Each node is thin: it hands its inputs to :mod:`.build`, :mod:`.unet` or :mod:`.vae`. Anything
that cannot be done (no usable backend, a precision the backend does not build, a VAE that is
not an LDM one) raises :class:`~sd_accel.core.SdAccelError` with what to do, which ComfyUI shows
on the node; the pack itself always loads.
"""

from __future__ import annotations

import logging

from sd_accel.profiles import PRESETS

log = logging.getLogger("sd_accel")

CATEGORY = "sd-accel"
BACKENDS = ("auto", "openvino", "onnxruntime", "tensorrt")
PRECISIONS = ("auto", "fp32", "fp16", "bf16", "int8-dynamic")


def _records_text(records) -> str:
    return "\n".join(f"{r.key.name}  ({r.key.model}, {r.key.component}, {r.build_seconds:.0f} s)" for r in records)


class SdAccelBuildEngines:
    """Build (or reuse) engines for a MODEL's UNet (plain and ControlNet-taking), a CLIP's text
    encoders and a VAE's decoder / encoder."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802  (ComfyUI's name)
        from sd_accel.comfyui.build import COMPONENT_CHOICES, CUSTOM

        return {
            "required": {
                "model": ("MODEL",),
                "components": (list(COMPONENT_CHOICES), {"default": "unet+vae_decoder"}),
                "preset": ([*PRESETS, CUSTOM], {"default": "static-512"}),
                "backend": (list(BACKENDS), {"default": "auto"}),
                "precision": (list(PRECISIONS), {"default": "auto"}),
            },
            "optional": {
                "vae": ("VAE",),
                "clip": ("CLIP",),
                "batch": ("STRING", {"default": "1-2", "tooltip": "N, MIN-MAX or MIN-OPT-MAX (custom preset)"}),
                "height": ("STRING", {"default": "512", "tooltip": "pixels, multiples of 8 (custom preset)"}),
                "width": ("STRING", {"default": "512", "tooltip": "pixels, multiples of 8 (custom preset)"}),
                "tokens": ("STRING", {"default": "77-154", "tooltip": "77 per prompt chunk (custom preset)"}),
                "text": ("STRING", {"default": "", "tooltip": "FLUX / SD3: T5 tokens, N or MIN-MAX (empty: "
                                    "ComfyUI's, FLUX 256, SD3 77)"}),
            },
        }

    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    FUNCTION = "build"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    DESCRIPTION = "Builds sd-accel engines for the MODEL (and VAE); returns the MODEL with the engines applied."

    def build(self, model, components, preset, backend, precision, vae=None, clip=None, batch="1-2", height="512",
              width="512", tokens="77-154", text=""):
        from sd_accel.comfyui.build import build, profile_for
        from sd_accel.comfyui.unet import apply_engines

        profile = profile_for(preset, batch, height, width, tokens, text)
        records = build(model, vae, tuple(components.split("+")), profile, backend, precision, clip=clip)
        applied, _ = apply_engines(model)
        return (applied, _records_text(records))


class SdAccelApplyEngines:
    """The MODEL with its UNet calls on engines where a profile covers them, PyTorch elsewhere."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = CATEGORY
    DESCRIPTION = ("UNet (and FLUX.1 / SD3 transformer) calls on sd-accel engines (LoRA loaders after this node "
                   "refit them; ControlNet residuals go to the residual-taking engine, built with unet_control: "
                   "SD 1.x/2.x/XL and FLUX.1); calls no engine covers and other patches run in PyTorch, counted and "
                   "said once.")

    def apply(self, model):
        from sd_accel.comfyui.unet import apply_engines

        applied, _ = apply_engines(model)
        return (applied,)


class SdAccelCLIPTextEncode:
    """ComfyUI's CLIP Text Encode with the text encoders on engines."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"text": ("STRING", {"multiline": True, "dynamicPrompts": True}), "clip": ("CLIP",)}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = ("CLIP Text Encode with each text encoder on its sd-accel engine (built by Build Engines with "
                   "clip in the components); a LoRA-patched encoder, or one without an engine, runs in PyTorch.")

    def encode(self, clip, text):
        from sd_accel.comfyui.clip import encode

        return (encode(clip, text),)


class SdAccelVAEDecode:
    """ComfyUI's VAE Decode with the decoder on engines."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, samples, vae):
        from sd_accel.comfyui.vae import decode

        return (decode(vae, samples["samples"]),)


class SdAccelVAEEncode:
    """ComfyUI's VAE Encode with the encoder on engines."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"pixels": ("IMAGE",), "vae": ("VAE",)}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, pixels, vae):
        from sd_accel.comfyui.vae import encode

        return ({"samples": encode(vae, pixels)},)


class SdAccelListEngines:
    """The engines in the folder, and which backends run here (and why not)."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):  # noqa: N802  (ComfyUI's name): list afresh every run
        return float("nan")

    RETURN_TYPES = ("STRING",)
    FUNCTION = "list"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True

    def list(self):
        from sd_accel.backends.registry import describe
        from sd_accel.comfyui.state import state

        st = state()
        lines = [f"engines in {st.engine_dir()}:"]
        lines += [f"  {line}" for line in _records_text(st.cache().list()).splitlines()] or ["  (none)"]
        lines.append("backends:")
        for row in describe(st.engine_dir()):
            how = "usable" if row["usable"] else f"not usable: {row['why_not']} ({row['install']})"
            lines.append(f"  {row['name']}{' (auto)' if row['auto'] else ''}: {how}")
        text = "\n".join(lines)
        return {"ui": {"text": [text]}, "result": (text,)}


class SdAccelDeleteEngine:
    """Delete one engine by name (as the list shows it), or every engine of a weights id."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"name": ("STRING", {"default": "", "tooltip": "an engine name or a weights id (ckpt-...)"})}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "delete"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True

    def delete(self, name):
        from sd_accel.comfyui.state import state
        from sd_accel.core import InvalidValue

        st = state()
        cache = st.cache()
        name = name.strip()
        targets = [r.key.name for r in cache.list() if name and (r.key.name == name or r.key.model == name)]
        if not targets:
            raise InvalidValue(f"no engine named {name!r} in {st.engine_dir()} (the sd-accel List Engines node "
                               "shows the names)")
        for target in targets:
            cache.delete(target)
        st.engines_changed()
        text = "deleted " + ", ".join(targets)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {
    "SdAccelBuildEngines": SdAccelBuildEngines,
    "SdAccelApplyEngines": SdAccelApplyEngines,
    "SdAccelCLIPTextEncode": SdAccelCLIPTextEncode,
    "SdAccelVAEDecode": SdAccelVAEDecode,
    "SdAccelVAEEncode": SdAccelVAEEncode,
    "SdAccelListEngines": SdAccelListEngines,
    "SdAccelDeleteEngine": SdAccelDeleteEngine,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "SdAccelBuildEngines": "sd-accel Build Engines",
    "SdAccelApplyEngines": "sd-accel Apply Engines",
    "SdAccelCLIPTextEncode": "sd-accel CLIP Text Encode",
    "SdAccelVAEDecode": "sd-accel VAE Decode",
    "SdAccelVAEEncode": "sd-accel VAE Encode",
    "SdAccelListEngines": "sd-accel List Engines",
    "SdAccelDeleteEngine": "sd-accel Delete Engine",
}


def setup() -> None:
    """What the pack does when ComfyUI loads it: checkpoint loads remember their file."""
    from sd_accel.comfyui import host

    if not host.tag_checkpoint_loads():
        log.warning("sd-accel: comfy.sd.load_checkpoint_guess_config not found: engines are keyed by the weights' "
                    "fingerprint, not shared with the WebUI")
