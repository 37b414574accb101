"""``comfy.supported_models``: the model_config classes the pack reads the family from (by name)."""


class SD15:
    """ComfyUI's supported_models.SD15."""


class SD3:
    unet_extra_config = {}
    sampling_settings = {"shift": 3.0}


class Flux:
    sampling_settings = {}


class FluxSchnell(Flux):
    sampling_settings = {"multiplier": 1.0, "shift": 1.0}
