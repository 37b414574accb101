"""The events of a built ``gr.Blocks``, as (event, trigger elem_id, fn, input elem_ids, output
elem_ids), on Gradio 3.41 (``dependencies`` dicts) and 4.x-6.x (``BlockFunction.targets``).

What a browser would run: tests call ``fn`` with the inputs' values and read the outputs by
elem_id, without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    event: str
    trigger: str | None  # the trigger component's elem_id (None: the Blocks itself, e.g. load)
    fn: Any
    inputs: list[str | None]
    outputs: list[str | None]


def _by_id(blocks) -> dict[int, Any]:
    return dict(getattr(blocks, "blocks", {}) or {})


def events(blocks) -> list[Event]:
    comps = _by_id(blocks)

    def elem(block_id):
        c = comps.get(block_id)
        return getattr(c, "elem_id", None) if c is not None else None

    out = []
    fns = blocks.fns
    fns = list(fns.values()) if isinstance(fns, dict) else list(fns)
    deps = getattr(blocks, "dependencies", None)
    if fns and hasattr(fns[0], "targets"):  # Gradio 4+
        for f in fns:
            ins = [getattr(c, "elem_id", None) for c in f.inputs]
            outs = [getattr(c, "elem_id", None) for c in f.outputs]
            for block_id, name in f.targets:
                out.append(Event(name, elem(block_id), f.fn, ins, outs))
        return out
    for dep, f in zip(deps or [], fns, strict=False):  # Gradio 3.x
        ins = [elem(i) for i in dep["inputs"]]
        outs = [elem(o) for o in dep["outputs"]]
        targets = dep.get("targets") or [None]
        for t in targets:
            out.append(Event(dep["trigger"], elem(t) if t is not None else None, f.fn, ins, outs))
    return out


def find(blocks, event: str, trigger: str | None = None, output: str | None = None) -> list[Event]:
    return [e for e in events(blocks) if e.event == event and (trigger is None or e.trigger == trigger)
            and (output is None or output in e.outputs)]
