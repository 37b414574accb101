"""Per-component counters: engine calls, torch calls and why each fallback happened."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("sd_accel")


@dataclass
class ComponentStats:
    """``engine_calls``/``torch_calls``: where the calls ran. ``fallbacks``: why calls ran torch.
    ``engine_skips``: engines passed over for one call (out of memory, a refused call), by
    engine and reason; the call then ran on another engine or torch. ``builds``: engines built
    on first use (``engines="auto"``), ``build_failures``: shapes whose build failed, by reason."""

    engine_calls: int = 0
    torch_calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    engines_used: Counter = field(default_factory=Counter)
    engine_skips: Counter = field(default_factory=Counter)
    builds: list = field(default_factory=list)
    build_failures: Counter = field(default_factory=Counter)
    _warned: set = field(default_factory=set, repr=False)

    def engine(self, name: str) -> None:
        self.engine_calls += 1
        self.engines_used[name] += 1

    def fallback(self, component: str, reason: str) -> None:
        """Count a torch call and warn once per reason: never silent, never noisy."""
        self.torch_calls += 1
        self.fallbacks[reason] += 1
        self._warn_once(reason, "%s: running torch for this call: %s", component, reason)

    def skip(self, component: str, engine: str, reason: str, warn: bool = True) -> None:
        """Count an engine passed over for one call; with ``warn``, warn once per engine and reason
        (a call that then falls back says it in the fallback's warning instead)."""
        key = f"{engine}: {reason}"
        self.engine_skips[key] += 1
        if not warn:
            return
        self._warn_once(("skip", key), "%s: engine %s skipped for this call, still in use for the next: %s",
                        component, engine, reason)

    def built(self, name: str) -> None:
        self.builds.append(name)

    def build_failed(self, reason: str) -> None:
        self.build_failures[reason] += 1

    def _warn_once(self, key, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_calls": self.engine_calls,
            "torch_calls": self.torch_calls,
            "fallbacks": dict(self.fallbacks),
            "engines_used": dict(self.engines_used),
            "engine_skips": dict(self.engine_skips),
            "builds": list(self.builds),
            "build_failures": dict(self.build_failures),
        }
