"""``modules/sd_hijack.py``: attention optimizations and the UNet forward patch.

``apply_optimizations`` picks an optimizer as the WebUI does ("Automatic": the first whose
command-line flag is set, else the highest priority available) and installs it; here an
optimizer sets the tiny UNet's diffusers attention processor (SDPA for sdp/xformers, the
default for "None"), which is what decides how attention appears in a traced graph.
"""

from __future__ import annotations

import importlib.util

from ldm.modules.diffusionmodules import openaimodel

from modules import sd_unet, shared


class SdOptimization:
    name = None
    label = None
    cmd_opt = None
    priority = 0

    def title(self):
        return self.name if self.label is None else f"{self.name} - {self.label}"

    def is_available(self):
        return True

    def apply(self):
        _set_processors(self.processor())

    def undo(self):
        _set_processors(None)

    def processor(self):
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()


class SdOptimizationXformers(SdOptimization):
    name, cmd_opt, priority = "xformers", "xformers", 100

    def is_available(self):
        return bool(shared.cmd_opts.xformers)


class SdOptimizationSdp(SdOptimization):
    name, label, cmd_opt, priority = "sdp", "scaled dot product", "opt_sdp_attention", 70


class SdOptimizationSubQuad(SdOptimization):
    name, priority = "sub-quadratic", 10


optimizers = []
current_optimizer = None
history: list[str] = []  # names applied, in order ("None" for plain attention)


def _set_processors(processor):
    if importlib.util.find_spec("modules_forge") is not None:
        return  # Forge 2 picks its attention at start-up (backend.attention); A1111's hijack is inert there
    model = shared.sd_model
    unet = getattr(getattr(model, "model", None), "diffusion_model", None)
    if unet is None:
        return
    from diffusers.models.attention_processor import AttnProcessor

    unet.unet.set_attn_processor(processor if processor is not None else AttnProcessor())


def list_optimizers():
    new_optimizers = [SdOptimizationXformers(), SdOptimizationSdp(), SdOptimizationSubQuad()]
    new_optimizers = [x for x in new_optimizers if x.is_available()]
    new_optimizers = sorted(new_optimizers, key=lambda x: x.priority, reverse=True)
    optimizers.clear()
    optimizers.extend(new_optimizers)


def undo_optimizations():
    _set_processors(None)


def apply_optimizations(option=None):
    global current_optimizer

    undo_optimizations()
    if len(optimizers) == 0:
        return ""
    if current_optimizer is not None:
        current_optimizer.undo()
        current_optimizer = None
    selection = option or shared.opts.cross_attention_optimization
    if selection == "Automatic" and len(optimizers) > 0:
        matching_optimizer = next(iter([x for x in optimizers if x.cmd_opt and getattr(shared.cmd_opts, x.cmd_opt, False)]), optimizers[0])
    else:
        matching_optimizer = next(iter([x for x in optimizers if x.title() == selection]), None)
    if selection == "None":
        matching_optimizer = None
    elif selection == "Automatic" and shared.cmd_opts.disable_opt_split_attention:
        matching_optimizer = None
    elif matching_optimizer is None:
        matching_optimizer = optimizers[0]
    if matching_optimizer is not None:
        print(f"Applying attention optimization: {matching_optimizer.name}... done.")
        matching_optimizer.apply()
        current_optimizer = matching_optimizer
        history.append(matching_optimizer.name)
        return current_optimizer.name
    print("Disabling attention optimization")
    history.append("None")
    return ""


class StableDiffusionModelHijack:
    optimization_method = None
    fixes = None  # textual-inversion fixes for the next text-encoder call (sd_hijack_clip)

    def hijack(self, m):
        """As the WebUI's: the text encoder wrapped for prompt chunking and embeddings, then the
        attention optimization."""
        from ldm.modules.encoders.modules import FrozenCLIPEmbedder

        from modules import sd_hijack_clip

        if isinstance(getattr(m, "cond_stage_model", None), FrozenCLIPEmbedder):
            transformer = m.cond_stage_model.transformer
            embeddings = getattr(transformer, "text_model", transformer).embeddings  # transformers 5: no text_model
            embeddings.token_embedding = sd_hijack_clip.EmbeddingsWithFixes(embeddings.token_embedding, self)
            m.cond_stage_model = sd_hijack_clip.FrozenCLIPEmbedderWithCustomWords(m.cond_stage_model, self)
        self.apply_optimizations()

    def undo_hijack(self, m):
        undo_optimizations()

    def apply_optimizations(self, option=None):
        try:
            self.optimization_method = apply_optimizations(option)
        except Exception as e:
            print(f"applying cross attention optimization: {e}")
            undo_optimizations()


model_hijack = StableDiffusionModelHijack()

# As sd_hijack does at import: UNetModel.forward goes through the SD-UNet dispatch.
if not hasattr(openaimodel, "copy_of_UNetModel_forward_for_webui"):
    openaimodel.copy_of_UNetModel_forward_for_webui = openaimodel.UNetModel.forward
openaimodel.UNetModel.forward = sd_unet.create_unet_forward(openaimodel.copy_of_UNetModel_forward_for_webui)
