"""What a model call carries that an engine does not compute: the names of the patches in ComfyUI's
``transformer_options`` (``patches``, ``patches_replace``) and of the functions other packs put there,
for the line that says why a call ran in PyTorch."""

from __future__ import annotations

from typing import Any


def callable_name(fn: Any) -> str:
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qual}".replace(".<locals>", "")


def patch_names(options: dict, key: str) -> list[str]:
    found = []
    for where, items in (options.get(key) or {}).items():
        if not items:
            continue
        if key == "patches_replace":  # {"attn1": {(block, n, idx): fn}, ...}
            fns = list(items.values()) if isinstance(items, dict) else list(items)
        else:
            fns = list(items) if isinstance(items, (list, tuple)) else [items]
        found.append(f"{where}: {', '.join(sorted({callable_name(f) for f in fns}))}")
    return found
