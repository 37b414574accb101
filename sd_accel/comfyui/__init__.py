"""sd-accel inside ComfyUI: the logic behind the custom-node pack in ``extension/comfyui``.

The pack's ``__init__.py`` only exports this package's node mappings (:mod:`.nodes`). The work
is done on ComfyUI's own objects (its LDM-layout UNet inside a ``ModelPatcher``, its ``VAE``),
reusing what :mod:`sd_accel.webui` has for the same original-layout modules:

- :mod:`.host`: the one place that imports ComfyUI's modules (``comfy.*``, ``folder_paths``);
- :mod:`.identity`: which weights a MODEL computes with (the checkpoint file's hash, the WebUI's
  ``ckpt-<hash>`` id, plus the patches ComfyUI's LoRA loaders added), so that engines are keyed
  as the WebUI keys them and shared with it;
- :mod:`.state`: the engine folder, the backend, engines per weights id, LoRA refits;
- :mod:`.unet`: the UNet wrappers (``outer_sample`` and ``diffusion_model``) a MODEL gets;
- :mod:`.vae`: VAE decode / encode on engines;
- :mod:`.build`: engines from a loaded MODEL / VAE, with ComfyUI's progress bar and interrupt;
- :mod:`.nodes`: the node classes (``INPUT_TYPES``, ``RETURN_TYPES``, ``FUNCTION``, ``CATEGORY``).

Tests run the same code against the stand-in ComfyUI in ``tests/comfyui_stub``.
"""
