"""Prompts longer than 75 tokens, encoded the WebUI way: 75-token chunks, each wrapped in
start/end tokens and padded to 77, encoded separately and concatenated (77, 154, 231 ... columns).

diffusers truncates at 77 tokens; pass these embeddings instead of the prompt text:

>>> from sd_accel import load_pipeline
>>> pipe = load_pipeline("builtin:tiny-sd15")
>>> embeds = encode_long_prompt(pipe, "a very long prompt, " * 20, "blurry")
>>> embeds["prompt_embeds"].shape[1]                                      # 154 columns: two chunks
154
>>> image = pipe(**embeds, height=64, width=64, num_inference_steps=2).images[0]
"""

from __future__ import annotations

import torch

from sd_accel.profiles import TOKEN_CHUNK

_BODY = TOKEN_CHUNK - 2


def token_chunks(tokenizer, text: str) -> list[list[int]]:
    """Full 77-id chunks for ``text`` (at least one, even for an empty prompt)."""
    ids = tokenizer(text, add_special_tokens=False, truncation=False).input_ids
    pieces = [ids[i : i + _BODY] for i in range(0, len(ids), _BODY)] or [[]]
    pad = tokenizer.pad_token_id
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [[bos, *p, eos] + [pad] * (_BODY - len(p)) for p in pieces]


def _pad_chunks(a: list, b: list, tokenizer) -> tuple[list, list]:
    empty = token_chunks(tokenizer, "")[0]
    n = max(len(a), len(b))
    return a + [empty] * (n - len(a)), b + [empty] * (n - len(b))


@torch.no_grad()
def _encode(encoder, chunks: list[list[int]], device, layer: int | None):
    hidden, pooled = [], None
    for i, chunk in enumerate(chunks):
        ids = torch.tensor([chunk], device=device)
        out = encoder(ids, output_hidden_states=layer is not None)
        hidden.append(out.hidden_states[layer] if layer is not None else out[0])
        if i == 0:
            pooled = out[0] if layer is not None else None
    return torch.cat(hidden, dim=1), pooled


def takes_argument(pipe, name: str) -> bool:
    """Whether ``pipe(...)`` reads the keyword argument ``name``: only when its signature names it.

    Strict on purpose: a ``**kwargs`` does not count. diffusers' ``LatentConsistencyModelPipeline``
    has one (for deprecated callbacks) and drops whatever else lands in it, so a negative prompt
    passed there would be ignored without a word.

    >>> from sd_accel import load_pipeline
    >>> takes_argument(load_pipeline("builtin:tiny-sd15"), "negative_prompt")
    True
    >>> takes_argument(load_pipeline("builtin:tiny-sd15-lcm"), "negative_prompt")
    False
    """
    import inspect

    return name in inspect.signature(pipe.__call__).parameters


def uses_negative_prompt(pipe, guidance_scale: float | None = None) -> bool:
    """Whether a call of ``pipe`` at ``guidance_scale`` reads a negative prompt: not without CFG
    (``guidance_scale <= 1``), not with a guidance-embedded UNet (LCM: ``time_cond_proj_dim``), and
    not in a pipeline that takes none (``LatentConsistencyModelPipeline``)."""
    if not takes_argument(pipe, "negative_prompt_embeds"):
        return False
    if getattr(getattr(getattr(pipe, "unet", None), "config", None), "time_cond_proj_dim", None) is not None:
        return False
    return guidance_scale is None or guidance_scale > 1


def encode_long_prompt(pipe, prompt: str, negative_prompt: str = "",
                       guidance_scale: float | None = None) -> dict[str, torch.Tensor]:
    """Keyword arguments for ``pipe(...)`` carrying the whole prompt, however long.

    ``guidance_scale``: the call's. Where the call reads no negative prompt
    (:func:`uses_negative_prompt`: no CFG, LCM) it is not encoded, and no negative embeddings are
    returned (an LCM pipeline would refuse them)."""
    device = pipe._execution_device
    negative = uses_negative_prompt(pipe, guidance_scale)
    if hasattr(pipe, "text_encoder_2"):
        return _encode_xl(pipe, prompt, negative_prompt, device, negative)
    pos = token_chunks(pipe.tokenizer, prompt)
    if not negative:
        return {"prompt_embeds": _encode(pipe.text_encoder, pos, device, None)[0]}
    pos, neg = _pad_chunks(pos, token_chunks(pipe.tokenizer, negative_prompt), pipe.tokenizer)
    return {
        "prompt_embeds": _encode(pipe.text_encoder, pos, device, None)[0],
        "negative_prompt_embeds": _encode(pipe.text_encoder, neg, device, None)[0],
    }


def _encode_xl(pipe, prompt: str, negative: str, device, with_negative: bool = True) -> dict[str, torch.Tensor]:
    out = {}
    pos1, pos2 = token_chunks(pipe.tokenizer, prompt), token_chunks(pipe.tokenizer_2, prompt)
    neg1, neg2 = (token_chunks(pipe.tokenizer, negative), token_chunks(pipe.tokenizer_2, negative)) \
        if with_negative else ([], [])
    n = max(len(pos1), len(neg1), len(pos2), len(neg2))
    empty1, empty2 = token_chunks(pipe.tokenizer, "")[0], token_chunks(pipe.tokenizer_2, "")[0]
    wanted = (("prompt", pos1, pos2), ("negative_prompt", neg1, neg2))[: 2 if with_negative else 1]
    for name, c1, c2 in wanted:
        c1 = c1 + [empty1] * (n - len(c1))
        c2 = c2 + [empty2] * (n - len(c2))
        h1, _ = _encode(pipe.text_encoder, c1, device, -2)
        h2, pooled = _encode(pipe.text_encoder_2, c2, device, -2)
        out[f"{name}_embeds"] = torch.cat([h1, h2], dim=-1)
        out[f"pooled_{name}_embeds"] = pooled
    if with_negative and not negative and pipe.config.get("force_zeros_for_empty_prompt", False):
        out["negative_prompt_embeds"] = torch.zeros_like(out["negative_prompt_embeds"])
        out["pooled_negative_prompt_embeds"] = torch.zeros_like(out["pooled_negative_prompt_embeds"])
    return out
