"""Per-component counters: engine calls, torch calls and why each fallback happened."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("sd_accel")


@dataclass
class ComponentStats:
    engine_calls: int = 0
    torch_calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    engines_used: Counter = field(default_factory=Counter)
    _warned: set = field(default_factory=set, repr=False)

    def engine(self, name: str) -> None:
        self.engine_calls += 1
        self.engines_used[name] += 1

    def fallback(self, component: str, reason: str) -> None:
        """Count a torch call and warn once per reason: never silent, never noisy."""
        self.torch_calls += 1
        self.fallbacks[reason] += 1
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("%s: running torch for this call: %s", component, reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_calls": self.engine_calls,
            "torch_calls": self.torch_calls,
            "fallbacks": dict(self.fallbacks),
            "engines_used": dict(self.engines_used),
        }
