"""Torch-level options applied by ``accelerate``: attention, precision and a safe VAE, offload."""
