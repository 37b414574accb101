"""Errors sd-accel raises on bad input. Each message says what was wrong and what to do."""

from __future__ import annotations


class SdAccelError(Exception):
    """Base class for sd-accel's own errors."""


class CheckpointError(SdAccelError, ValueError):
    """A model file that cannot be loaded: unknown family, truncated, not a checkpoint, unsafe."""
