"""A stand-in for AUTOMATIC1111's ``modules`` package, for sd-accel's extension tests.

It follows the real WebUI's module names, classes, callback registration and call signatures
(A1111 1.8-1.10; Forge's additions under ``../forge``), reduced to what an extension touches:

- ``script_callbacks``: ``callback_map`` lists, ``on_*`` registration, ``*_callback`` runners
  that catch and report a failing callback as the WebUI does (a raising ``on_ui_tabs`` callback
  loses its tab);
- ``shared``: ``opts`` (``add_option``, ``OptionInfo``, ``set``, ``save``), ``cmd_opts``
  (medvram, lowvram, xformers, no_half, no_half_vae ...), ``sd_model``;
- ``sd_unet``: the real module's code (options, ``apply_unet`` moving the torch UNet to the CPU,
  ``create_unet_forward``);
- ``sd_hijack``: attention optimizations with the real selection rule, and the class-level
  ``UNetModel.forward`` patch that dispatches to ``sd_unet.current_unet``;
- ``lowvram``: ``setup_for_low_vram`` forward pre-hooks (recording instead of moving to a GPU);
- ``sd_models``: ``CheckpointInfo`` (sha256 / shorthash / title / model_name), ``load_model``,
  ``reload_model_weights``, ``get_closet_checkpoint_match``;
- ``scripts``: ``Script``, ``AlwaysVisible``, ``ScriptRunner``, script loading from an
  extension's ``scripts/`` folder;
- ``processing``: ``StableDiffusionProcessingTxt2Img`` and ``process_images``: the hook order of
  ``process_images_inner``, A1111's CFG denoiser batching (``batch_cond_uncond``, cond and
  uncond apart when their token counts differ), hires fix's second pass; on Forge the
  ``process_before_every_sampling`` hook and sampling through the UNet patcher;
- ``call_queue``, ``paths``, ``devices``, ``extra_networks`` (``<lora:name:w>`` parsing), ``ui``
  (renders ``on_ui_tabs`` tabs like ``ui.create_ui``).

The checkpoints' UNet (``ldm.modules.diffusionmodules.openaimodel.UNetModel``) is a small
LDM-style UNet with the WebUI's call signature ``forward(x, timesteps=None, context=None,
y=None, **kwargs)``, wrapping a tiny diffusers ``UNet2DConditionModel``. For SDXL, ``y`` is what
LDM's ``label_emb`` consumes (pooled text embedding concatenated with the embedded size/crop
ids); it feeds diffusers' ``class_embed_type="projection"`` embedding, which is the same
Linear-SiLU-Linear added to the time embedding as ``label_emb`` (diffusers' SDXL
``add_embedding`` is that layer too, behind a time-id projection the WebUI does outside the UNet).
"""
