"""``comfy.model_management``: the interrupt flag, devices, loading models for sampling."""

from __future__ import annotations

import threading

import torch


class InterruptProcessingException(Exception):
    pass


interrupt_processing_mutex = threading.RLock()
interrupt_processing = False


def interrupt_current_processing(value=True):
    global interrupt_processing
    with interrupt_processing_mutex:
        interrupt_processing = value


def processing_interrupted():
    with interrupt_processing_mutex:
        return interrupt_processing


def throw_exception_if_processing_interrupted():
    global interrupt_processing
    with interrupt_processing_mutex:
        if interrupt_processing:
            interrupt_processing = False
            raise InterruptProcessingException()


def get_torch_device():
    return torch.device("cpu")


def load_models_gpu(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                    force_full_load=False):
    """As ComfyUI's: each model's patches written into its weights (a model whose weights carry
    another clone's patches gets them taken out first)."""
    for m in models:
        m.load()
