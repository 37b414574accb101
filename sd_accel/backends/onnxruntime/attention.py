"""Fuse the exported attention blocks into ONNX Runtime's ``com.microsoft.MultiHeadAttention``.

ONNX Runtime does not fuse ``MatMul -> Softmax -> MatMul`` by itself, so a plain attention block
holds its ``[B, H, N, L]`` scores and probabilities: gigabytes per call at 512-768 px, growing
with tokens squared. Its ``MultiHeadAttention`` contrib op takes Q, K, V as ``[B, S, H * d]``
with ``num_heads`` and ``scale`` attributes; the CPU kernel runs a flash attention (tiles of Q x K
sized to the L2 cache, no full score tensor; float32 only) and the CUDA provider has fused
kernels too.

:func:`fuse_attention` matches exactly the block ``sd_accel.onnx.attention.ExportAttnProcessor``
traces (see there)::

    q_proj -> Reshape -> Transpose(0,2,1,3) -> Mul(scale) ─┐
    k_proj -> Reshape -> Transpose(0,2,3,1) ───────────────┴─ MatMul -> Softmax ─┐
    v_proj -> Reshape -> Transpose(0,2,1,3) ─────────────────────────────────────┴─ MatMul
          -> Transpose(0,2,1,3) -> Reshape                                    ==> out [B, S, H * d]

and replaces it with ``MultiHeadAttention(q_proj, k_proj, v_proj)``. Anything else (a mask, a
different layout) is left as it is. It works on the graph alone: a model loaded without its
external data is rewritten in memory, weights untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("sd_accel")

MS_DOMAIN = "com.microsoft"
_HEADS_FIRST = [0, 2, 1, 3]
_KEY_T = [0, 2, 3, 1]


class _Graph:
    """Producer/consumer maps and constant lookup over an ``onnx.GraphProto``."""

    def __init__(self, graph, base_dir: Path | None) -> None:
        self.graph = graph
        self.base_dir = base_dir
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.outputs = {o.name for o in graph.output}

    def op(self, name: str, op_type: str):
        """The node producing ``name`` when it is an ``op_type``, else None."""
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def only_consumer(self, name: str, op_type: str):
        """The single node reading ``name`` when it is an ``op_type`` (and ``name`` is no graph output)."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.outputs or users[0].op_type != op_type:
            return None
        return users[0]

    def constant(self, name: str) -> np.ndarray | None:
        from onnx import numpy_helper

        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name], str(self.base_dir or ""))
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
        return None


def _perm(node) -> list[int]:
    for attr in node.attribute:
        if attr.name == "perm":
            return list(attr.ints)
    return []


def _split_heads(g: _Graph, name: str, perm: list[int]) -> tuple[str, int] | None:
    """(the ``[B, S, D]`` tensor before the head split, number of heads) when ``name`` is
    ``Transpose(perm)(Reshape(x, [B, S, H, d]))`` and nothing else reads the intermediates."""
    transpose = g.op(name, "Transpose")
    if transpose is None or _perm(transpose) != perm or len(g.consumers.get(name, [])) != 1:
        return None
    reshape = g.op(transpose.input[0], "Reshape")
    if reshape is None or len(g.consumers.get(reshape.output[0], [])) != 1:
        return None
    heads = _heads(g, reshape.input[1])
    return (reshape.input[0], heads) if heads else None


def _heads(g: _Graph, shape_name: str) -> int | None:
    """H from a Reshape's target shape ``[B, S, H, d]``: a constant, or a Concat whose third part is."""
    shape = g.constant(shape_name)
    if shape is not None:
        return int(shape[2]) if shape.size == 4 and shape[2] > 0 else None
    concat = g.op(shape_name, "Concat")
    if concat is None or len(concat.input) != 4:
        return None
    part = g.constant(concat.input[2])
    return int(part.reshape(-1)[0]) if part is not None and part.size == 1 and part.reshape(-1)[0] > 0 else None


def _match(g: _Graph, softmax) -> tuple[list, list[str], str, int, float] | None:
    """(nodes to drop, [q, k, v] inputs, output name, heads, scale) for one attention block."""
    axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1)
    if axis not in (-1, 3):
        return None
    scores = g.op(softmax.input[0], "MatMul")
    if scores is None or len(g.consumers.get(scores.output[0], [])) != 1:
        return None
    weighted = g.only_consumer(softmax.output[0], "MatMul")
    if weighted is None or weighted.input[0] != softmax.output[0]:
        return None
    mul = g.op(scores.input[0], "Mul")
    if mul is None or len(g.consumers.get(mul.output[0], [])) != 1:
        return None
    scale = g.constant(mul.input[1])
    q_side = mul.input[0]
    if scale is None:
        scale, q_side = g.constant(mul.input[0]), mul.input[1]
    if scale is None or scale.size != 1:
        return None
    q = _split_heads(g, q_side, _HEADS_FIRST)
    k = _split_heads(g, scores.input[1], _KEY_T)
    v = _split_heads(g, weighted.input[1], _HEADS_FIRST)
    if q is None or k is None or v is None or not q[1] == k[1] == v[1]:
        return None
    merge_t = g.only_consumer(weighted.output[0], "Transpose")
    if merge_t is None or _perm(merge_t) != _HEADS_FIRST:
        return None
    merge = g.only_consumer(merge_t.output[0], "Reshape")
    if merge is None:
        return None
    drop = [softmax, scores, weighted, mul, merge_t, merge]
    for name in (q_side, scores.input[1], weighted.input[1]):
        transpose = g.producer[name]
        drop += [transpose, g.producer[transpose.input[0]]]
    return drop, [q[0], k[0], v[0]], merge.output[0], q[1], float(scale.reshape(-1)[0])


def _drop_dead(graph) -> int:
    """Remove nodes whose outputs nobody reads (the head-split shape arithmetic left behind)."""
    removed = 0
    while True:
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output if o)]
        if not dead:
            return removed
        for node in dead:
            graph.node.remove(node)
        removed += len(dead)


def fuse_attention(model, base_dir: Path | None = None) -> int:
    """Rewrite every matching attention block of ``model`` (in place) into ``MultiHeadAttention``;
    returns how many were fused. ``base_dir``: where external constants live (small ones, the
    scale and shapes, are normally inside the model)."""
    import onnx

    g = _Graph(model.graph, base_dir)
    fused: list[tuple[list, object]] = []
    for node in list(model.graph.node):
        if node.op_type != "Softmax":
            continue
        found = _match(g, node)
        if found is None:
            continue
        drop, (q, k, v), out, heads, scale = found
        name = node.name.rsplit("/", 1)[0] + "/MultiHeadAttention" if "/" in node.name else f"{node.name}_mha"
        mha = onnx.helper.make_node("MultiHeadAttention", [q, k, v], [out], name=name, domain=MS_DOMAIN,
                                    num_heads=heads, scale=scale)
        fused.append((drop, mha))
    if not fused:
        return 0
    position = {id(n): i for i, n in enumerate(model.graph.node)}
    keep = [n for n in model.graph.node if id(n) not in {id(d) for drop, _ in fused for d in drop}]
    # Each fused node takes the place of its block's last node, so the graph stays topologically sorted.
    placed = sorted(((max(position[id(d)] for d in drop), mha) for drop, mha in fused), key=lambda p: p[0])
    nodes = list(keep)
    for index, mha in reversed(placed):
        before = sum(1 for n in keep if position[id(n)] < index)
        nodes.insert(before, mha)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead(model.graph)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    # Shapes recorded for the removed intermediates would only confuse later passes.
    gone = {o for drop, _ in fused for d in drop for o in d.output} - {mha.output[0] for _, mha in fused}
    kept_info = [vi for vi in model.graph.value_info if vi.name not in gone]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    log.debug("fused %d attention blocks into MultiHeadAttention", len(fused))
    return len(fused)


def count_unfused(model) -> int:
    """Softmax nodes left in ``model`` (attention ``fuse_attention`` did not match, CLIP's among them)."""
    return sum(1 for n in model.graph.node if n.op_type == "Softmax")
