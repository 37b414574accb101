"""FLUX.1 (dev, schnell): the transformer's component spec and what its ONNX export needs. Its
text encoders are the shared CLIP-L (pooled only) and T5 specs, its VAE the shared KL VAE's."""

from sd_accel.components.flux.transformer import FluxTransformerSpec, image_ids, is_flux_transformer

__all__ = ["FluxTransformerSpec", "image_ids", "is_flux_transformer"]
