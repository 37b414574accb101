"""AUTOMATIC1111: engines as an entry of the SD-UNet list (``modules.sd_unet``).

``on_list_unets`` adds one :class:`SdAccelUnetOption` per checkpoint with engines here, named
after the checkpoint (``model_name``), so the "Automatic" SD-UNet choice picks it whenever that
checkpoint is loaded. The WebUI then routes every ``UNetModel.forward`` to
:meth:`SdAccelUnet.forward` (``sd_hijack`` patches ``forward`` with
``sd_unet.create_unet_forward``), which serves each call from the engines of the job's weights
(checkpoint + LoRAs) and runs the torch UNet for whatever they do not cover.
"""

from __future__ import annotations

import logging

import torch
from modules import sd_unet

from sd_accel.webui import host
from sd_accel.webui.controller import Controller, controller

log = logging.getLogger("sd_accel")

LABEL_PREFIX = "[sd-accel] "


class SdAccelUnetOption(sd_unet.SdUnetOption):
    """One checkpoint's engines in the SD-UNet list."""

    def __init__(self, ckpt_hash: str, model_name: str, title: str, ctl: Controller | None = None) -> None:
        self.ckpt_hash = ckpt_hash
        self.model_name = model_name  # "Automatic" matches this against sd_checkpoint_info.model_name
        self.label = f"{LABEL_PREFIX}{model_name}"
        self.title = title
        self.controller = ctl or controller()

    def create_unet(self) -> SdAccelUnet:
        return SdAccelUnet(self)


def list_unets(unet_list: list) -> None:
    """``script_callbacks.on_list_unets`` callback: one option per checkpoint with engines."""
    for ckpt in controller().checkpoints():
        unet_list.append(SdAccelUnetOption(ckpt["hash"], ckpt["model_name"], ckpt["title"]))


class SdAccelUnet(sd_unet.SdUnet):
    """Stands in for the UNet while its option is active (``sd_unet.current_unet``)."""

    def __init__(self, option: SdAccelUnetOption) -> None:
        super().__init__()
        self.option = option
        self.controller = option.controller
        self._moved_back = False

    def activate(self) -> None:
        # The WebUI has just moved the torch UNet to the CPU (apply_unet) to make room: it stays
        # there until a call needs it (see _torch).
        self._moved_back = False
        log.info("sd-accel: engines of %s active", self.option.title)

    def deactivate(self) -> None:
        self.controller.release()

    # ---- the call

    def forward(self, x, timesteps, context, *args, **kwargs):
        y = kwargs.get("y")
        reason = self._torch_reason(args, kwargs)
        engines = None
        if reason is None:
            wid = self.controller.wanted_weights()
            engines, reason = self.controller.engines_or_reason(wid)
            if engines is None and reason is None:
                engines, why = self._refitted()
                if engines is None:
                    reason = self._no_engines_reason(wid, why)
        if engines is None:
            self._count_torch(reason)
            return self._torch(x, timesteps, context, args, kwargs)
        self.controller.job.used.add(engines.weights_id)

        def torch_part(part: slice) -> torch.Tensor:
            sliced = dict(kwargs, y=y[part]) if y is not None else kwargs
            return self._torch(x[part], timesteps[part], context[part], args, sliced)

        return engines(x, timesteps, context, y, torch_part)

    def _torch_reason(self, args: tuple, kwargs: dict) -> str | None:
        """Why this call cannot go to an engine at all (None: it may)."""
        if args:
            return "positional arguments beyond (x, timesteps, context)"
        extra = sorted(k for k, v in kwargs.items() if k != "y" and v is not None)
        if extra:
            return f"arguments the engine was not built for: {', '.join(extra)}"
        if self.controller.job.torch_only:
            return self.controller.job.torch_only
        loaded = host.checkpoint_info()
        from sd_accel.webui.identity import checkpoint_hash

        if checkpoint_hash(loaded) != self.option.ckpt_hash:
            return (f"the SD-UNet '{self.option.label}' is for another checkpoint than the loaded "
                    f"{getattr(loaded, 'title', '?')}; pick 'Automatic' or build engines for it")
        return None

    def _refitted(self):
        """The checkpoint's engines refitted for the job's LoRAs (A1111's Lora extension merges
        them into the UNet first), or (None, why not)."""
        from sd_accel.webui.lora import a1111_merge

        loras = self.controller.job.loras
        if not loras:
            return None, None
        unet = host.loaded_unet()
        return self.controller.lora_engines(self.option.ckpt_hash, loras, unet, a1111_merge(unet, loras))

    def _no_engines_reason(self, wid: str, why: str | None = None) -> str:
        because = f": {why}" if why else ""
        return (f"no engine for {self.option.title} with {self.controller.describe_job()}{because} "
                "(build one in the sd-accel tab while these LoRAs are applied)")

    def _count_torch(self, reason: str) -> None:
        # Counted on the engines of the checkpoint itself when there are any, so the job's
        # report has it; otherwise the job note says it once.
        engines, _ = self.controller.engines_or_reason(f"ckpt-{self.option.ckpt_hash}")
        if engines is not None:
            engines.torch_call(reason)
        else:
            self.controller.note(f"running the UNet in PyTorch: {reason}")

    def _move_next_to(self, unet: torch.nn.Module, x: torch.Tensor) -> None:
        """The torch UNet back on ``x``'s device if the WebUI parked it on the CPU (``apply_unet``
        does when an SD-UNet is active), unless the WebUI manages it (lowvram)."""
        param = next(unet.parameters(), None)
        if param is not None and param.device != x.device and not getattr(host.sd_model(), "lowvram", False):
            unet.to(x.device)
            if not self._moved_back:
                self._moved_back = True
                log.info("sd-accel: moved the PyTorch UNet to %s for calls no engine covers", x.device)

    def _torch(self, x, timesteps, context, args: tuple, kwargs: dict) -> torch.Tensor:
        """The WebUI's own UNet for this call: moved back next to the input if the WebUI
        parked it on the CPU, called with the SD-UNet dispatch off."""
        unet = host.loaded_unet()
        self._move_next_to(unet, x)
        saved = sd_unet.current_unet
        sd_unet.current_unet = None  # else UNetModel.forward would hand the call back to us
        try:
            return unet(x, timesteps, context, *args, **kwargs)
        finally:
            sd_unet.current_unet = saved


# --------------------------------------------------------------------------- forward hooks of others

HOOK_MARK = "_sd_accel_counted_hook"


def _hook_name(forward) -> str:
    fn = getattr(forward, "__func__", forward)
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}".replace(".<locals>", "")
    return f"sd-webui-controlnet's UNet hook ({where}: ControlNet / T2I-Adapter / reference units)"


def watch_forward_hooks(ctl: Controller | None = None) -> str | None:
    """``process_batch`` on AUTOMATIC1111: when sd-webui-controlnet has hooked the UNet (for every
    job with a ControlNet unit its ``UnetHook`` sets ``forward`` on the module itself, keeping the
    one it replaced as ``_original_forward``, and runs the UNet's blocks itself with its residuals
    added in between), no call of this job reaches the SD-UNet, so the engines cannot serve it. The UNet then runs in
    PyTorch for the job, said once and counted per call in the job's report (the hook's forward
    is wrapped by a counter, which its own restore removes with it), and the torch UNet is put
    back on the input's device first (the active SD-UNet had parked it on the CPU). Returns the
    reason, or None when nothing replaced the forward or no sd-accel SD-UNet is active."""
    ctl = ctl or controller()
    current = sd_unet.current_unet
    if not isinstance(current, SdAccelUnet):
        return None
    try:
        unet = host.loaded_unet()
    except Exception:  # no model loaded: nothing to watch
        return None
    forward = unet.__dict__.get("forward")
    if forward is None or getattr(forward, "__func__", None) is getattr(type(unet), "forward", None):
        return None  # none, or the class's own put back (sd-webui-controlnet's restore leaves it so)
    if not hasattr(unet, "_original_forward") and getattr(forward, HOOK_MARK, None) is None:
        # Only sd-webui-controlnet's hook is known to bypass the class's forward; a wrapper that
        # calls through to it still reaches the SD-UNet, and its calls are served as usual.
        return None
    if getattr(forward, HOOK_MARK, None) is not None:
        return getattr(forward, HOOK_MARK)
    reason = (f"{_hook_name(forward)} runs the UNet itself, so no call reaches the engine: the UNet runs in "
              "PyTorch for this job (on Forge, its built-in ControlNet runs on the unet_control engine)")
    # also calls the hook passes on to the UNet's own forward (its reference modes)
    ctl.job.torch_only = ctl.job.torch_only or reason
    ctl.note(reason)

    def counted(*args, **kwargs):
        x = args[0] if args else kwargs.get("x")
        current._count_torch(reason)
        if isinstance(x, torch.Tensor):
            current._move_next_to(unet, x)
        return forward(*args, **kwargs)

    setattr(counted, HOOK_MARK, reason)
    unet.forward = counted
    return reason
