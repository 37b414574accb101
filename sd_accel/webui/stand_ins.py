"""The VAE and the text encoder on engines inside the WebUI.

The UNet comes in through the WebUI's own ways (A1111's SD-UNet, Forge's UNet patcher). The VAE
and the text encoder have none, so each of their modules gets a ``forward`` of its own: an
instance attribute, which ``nn.Module.__call__`` prefers over the class's method, the way A1111's
hijacks and the Tiled VAE extension patch these modules. The weights and their ``state_dict``
keys stay where they are (``sd_vae`` still loads VAE files into the same module), and every call
is matched on its real shapes, as the UNet's are:

- ``first_stage_model.decoder`` (``ldm_vae_decoder``): ``decoder(z)``, one image per call on
  A1111; a tile of Forge's tiled decoding is another shape, and runs in PyTorch;
- ``first_stage_model.encoder`` (``ldm_vae_encoder``): ``encoder(x)``, img2img's init image;
- the transformers ``CLIPTextModel`` (``ldm_clip``): ``transformer(input_ids=tokens,
  output_hidden_states=...)`` on 77-token chunks. A prompt with textual-inversion embeddings
  (A1111's and Forge 2's ``EmbeddingsWithFixes`` hold them in ``fixes`` for the next call) runs
  in PyTorch; so does any call with an attention mask or ``inputs_embeds``.

Each call asks the controller for the engines of the weights it computes with right now (the
checkpoint, a separate VAE file, the LoRAs merged into the text encoder); none, or none that
covers the call: the module's own forward, counted and said once per reason, as for the UNet.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from sd_accel.components.ldm_clip import COMPONENT as CLIP
from sd_accel.components.ldm_clip import is_clip_text_model
from sd_accel.components.ldm_control_unet import COMPONENT as CONTROL
from sd_accel.components.ldm_vae import DECODER, ENCODER, is_ldm_decoder, is_ldm_encoder
from sd_accel.webui import host

log = logging.getLogger("sd_accel")

# user-facing component names (tab, API) -> engine component names
# (``unet_control``: the UNet taking ControlNet residuals, what Forge's ControlNet calls use)
COMPONENTS = {"unet": "ldm_unet", "vae_decoder": DECODER, "vae_encoder": ENCODER, "clip": CLIP,
              "unet_control": CONTROL}
LABELS = {"ldm_unet": "UNet", DECODER: "VAE decoder", ENCODER: "VAE encoder", CLIP: "text encoder",
          CONTROL: "UNet with ControlNet residuals", "transformer": "transformer"}
MARK = "_sd_accel_component"


def find_modules(model=None) -> dict[str, torch.nn.Module]:
    """The modules of the loaded model that engines can stand in for, by engine component name
    (the UNet is found by :func:`sd_accel.webui.host.loaded_unet`)."""
    model = model if model is not None else host.sd_model()
    out: dict[str, torch.nn.Module] = {}
    vae = host.first_stage(model)
    if vae is not None:
        if is_ldm_decoder(getattr(vae, "decoder", None)):
            out[DECODER] = vae.decoder
        if is_ldm_encoder(getattr(vae, "encoder", None)):
            out[ENCODER] = vae.encoder
    for root in host.text_encoder_roots(model):
        found = next((m for m in root.modules() if is_clip_text_model(m)), None)
        if found is not None:
            out[CLIP] = found
            break
    return out


def why_not(component: str) -> str:
    """Why this WebUI's model has no module for ``component`` (for the build's "not built" list)."""
    if component == CLIP:
        return ("its text encoder is not a transformers CLIPTextModel (an OpenCLIP one, as SD 2.x has): it "
                "stays in PyTorch")
    return "this model has no LDM VAE there: it stays in PyTorch"


# --------------------------------------------------------------------------- the stand-in forwards


class EngineForward:
    """The ``forward`` an engine-backed module gets: engines where they cover, else the module's own."""

    def __init__(self, component: str, module: torch.nn.Module, previous: Callable | None, ctl) -> None:
        self.component = component
        self.module = module
        self.previous = previous  # another extension's instance forward, kept in the chain
        self.controller = ctl

    def torch_forward(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        try:
            served = self.serve(args, kwargs)
        except Exception as exc:  # an engine problem must never stop an image: torch, and say so
            self.controller.say_once(f"{LABELS[self.component]} engine failed, PyTorch runs it: "
                                     f"{type(exc).__name__}: {exc}")
            served = None
        return self.torch_forward(*args, **kwargs) if served is None else served

    def serve(self, args: tuple, kwargs: dict):
        """The engines' result, or None: run the module's own forward (counted where engines exist)."""
        wid = self.controller.weights_for(self.component)
        if wid is None:
            return None
        engines, _ = self.controller.engines_or_reason(wid, self.component)
        if engines is None:
            return None
        feed, reason = self.feed(args, kwargs)
        if reason is not None:
            engines.torch_call(reason)
            return None
        out = run_chunked(engines, feed)
        if out is None:  # no engine covers these shapes: counted and said by the engines
            return None
        self.controller.job.used.add(wid)
        return self.result(out, args, kwargs)

    def feed(self, args: tuple, kwargs: dict) -> tuple[dict | None, str | None]:
        raise NotImplementedError

    def result(self, out: dict, args: tuple, kwargs: dict):
        raise NotImplementedError

    def _like(self, t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        # copy: the engine reuses its output buffer on the next call
        return t.to(device=ref.device, dtype=ref.dtype, copy=True)


def run_chunked(engines, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The engines' outputs for ``feed``; a batch larger than every engine is cut into the largest
    chunks some engine covers (rows are independent: the VAE's images, the text encoder's prompts)
    and the outputs joined. None when some rows fit no engine: the whole call then runs in
    PyTorch, counted once (by ``engines.run``)."""
    from sd_accel.core import covers

    batch = next(iter(feed.values())).shape[0]
    live = [h for h in engines.handles if h.broken is None]

    def served(size: int) -> bool:
        return any(covers(h.shapes, {k: v[:size] for k, v in feed.items()}) for h in live)

    if served(batch) or not served(1):
        return engines.run(feed)
    parts, start = [], 0
    while start < batch:
        size = next(b for b in range(batch - start, 0, -1) if served(b))
        out = engines.run({k: v[start:start + size] for k, v in feed.items()})
        if out is None:
            return None
        parts.append({k: v.clone() for k, v in out.items()})  # the next run reuses the buffers
        start += size
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _extra(kwargs: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(k for k, v in kwargs.items() if k not in allowed and v is not None)


class VaeForward(EngineForward):
    """``decoder(z)`` / ``encoder(x)``: one tensor in, one out."""

    input_name = {DECODER: "z", ENCODER: "images"}
    output_name = {DECODER: "images", ENCODER: "moments"}

    def feed(self, args, kwargs):
        extra = _extra(kwargs)
        if extra or len(args) != 1 or not torch.is_tensor(args[0]):
            return None, f"arguments the engine was not built for: {', '.join(extra) or 'positional'}"
        return {self.input_name[self.component]: args[0].float()}, None

    def result(self, out, args, kwargs):
        return self._like(out[self.output_name[self.component]], args[0])


class ClipForward(EngineForward):
    """``transformer(input_ids, output_hidden_states=...)`` -> transformers' output object."""

    def feed(self, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        extra = _extra(dict(kwargs), ("input_ids", "output_hidden_states", "return_dict"))
        if len(args) > 1:
            extra.append("positional arguments")
        if extra or not torch.is_tensor(ids):
            return None, f"arguments the engine was not built for: {', '.join(extra) or 'no input_ids'}"
        fixes = _pending_fixes(self.module)
        if fixes:
            return None, "textual-inversion embeddings in the prompt"
        return {"input_ids": ids.to(torch.int32)}, None

    def result(self, out, args, kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        _clear_fixes(self.module)  # what the embedding layer would have done with them
        ids = args[0] if args else kwargs["input_ids"]
        param = next(self.module.parameters(), None)
        ref = torch.empty(0, device=ids.device, dtype=param.dtype if param is not None else torch.float32)
        hidden = None
        if kwargs.get("output_hidden_states", self.module.config.output_hidden_states):
            n = sum(1 for k in out if k.startswith("hidden_states."))
            hidden = tuple(self._like(out[f"hidden_states.{i}"], ref) for i in range(n))
        result = BaseModelOutputWithPooling(last_hidden_state=self._like(out["last_hidden_state"], ref),
                                            pooler_output=self._like(out["pooler_output"], ref),
                                            hidden_states=hidden)
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.module.config, "return_dict", True)
        return result if return_dict else result.to_tuple()


def _fixes_owner(module: torch.nn.Module):
    text_model = getattr(module, "text_model", module)  # transformers 5 dropped the text_model level
    embedding = getattr(getattr(text_model, "embeddings", None), "token_embedding", None)
    return getattr(embedding, "embeddings", None)  # the hijack that holds ``fixes``


def _pending_fixes(module: torch.nn.Module) -> bool:
    fixes = getattr(_fixes_owner(module), "fixes", None)
    return bool(fixes) and any(len(f) for f in fixes if f is not None)


def _clear_fixes(module: torch.nn.Module) -> None:
    owner = _fixes_owner(module)
    if owner is not None and hasattr(owner, "fixes"):
        owner.fixes = None


_KINDS = {DECODER: VaeForward, ENCODER: VaeForward, CLIP: ClipForward}


def install(model, ctl) -> list[str]:
    """Give the model's VAE halves and text encoder their engine forwards (once); returns the
    components now standing in."""
    done = []
    for component, module in find_modules(model).items():
        current = module.__dict__.get("forward")
        if getattr(current, MARK, None) == component and getattr(current, "controller", None) is ctl:
            done.append(component)
            continue
        previous = current if callable(current) else None
        if isinstance(previous, EngineForward):  # ours from an earlier controller: keep its chain only
            previous = previous.previous
        forward = _KINDS[component](component, module, previous, ctl)
        setattr(forward, MARK, component)
        module.__dict__["forward"] = forward
        done.append(component)
    return done


@contextlib.contextmanager
def own_forward(module: torch.nn.Module) -> Iterator[None]:
    """The module's own forward for the block (exports trace it, validation compares with it)."""
    current = module.__dict__.get("forward")
    if not isinstance(current, EngineForward):
        yield
        return
    if current.previous is not None:
        module.__dict__["forward"] = current.previous
    else:
        del module.__dict__["forward"]
    try:
        yield
    finally:
        module.__dict__["forward"] = current


__all__ = ["COMPONENTS", "LABELS", "EngineForward", "find_modules", "install", "own_forward", "why_not"]
