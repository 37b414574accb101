"""A stand-in for Forge 2's ``backend`` package: the UNet patcher, ``KModel``, memory-driven
cond/uncond batching (see ``sampling.sampling_function``) and the model loader."""
