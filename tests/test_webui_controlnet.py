"""ControlNet in the WebUI (the stand-in WebUI and Forge in ``tests/webui_stub``).

Forge runs its built-in ControlNet apart from the UNet (the nets chained on the UNet patcher,
called by the sampling function) and hands the UNet ``control={"output": [...], "middle": [...]}``
plus the net itself as ``control_model``. Those calls go to the residual-taking engine
(``unet_control``) of the same weights; without one they run in PyTorch, counted and said.

AUTOMATIC1111's sd-webui-controlnet replaces the UNet's ``forward`` on the module and runs its
blocks itself: no call reaches the SD-UNet, so the job runs in PyTorch, counted and said, with
the torch UNet on the input's device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)
EXACT = {"sd_accel_backend": "onnxruntime"}  # fp32 engines: jobs match PyTorch to 2e-3
TOL = dict(atol=2e-3, rtol=2e-3)


class ForgeControlNet:
    """Forge's ``ControlNet`` (``backend/patcher/controlnet.py``) as the sampling function uses it:
    a tiny diffusers ControlNetModel made from the checkpoint's UNet, run on the call's rows with
    the predictor's input scaling and timesteps; residuals times ``strength`` in ``control_merge``'s
    layout (``output`` in input-block order, ``middle``), summed with the previous net's."""

    def __init__(self, unet: torch.nn.Module, hint: torch.Tensor, strength: float = 1.0, seed: int = 0) -> None:
        from sd_accel.models.tiny_controlnet import tiny_controlnet

        self.net = tiny_controlnet(unet, seed=seed).eval()
        self.hint = hint
        self.strength = strength
        self.previous_controlnet = None

    def set_previous_controlnet(self, previous) -> None:
        self.previous_controlnet = previous

    @torch.no_grad()
    def get_control(self, x_noisy, t, cond, batched_number):
        prev = None
        if self.previous_controlnet is not None:
            prev = self.previous_controlnet.get_control(x_noisy, t, cond, batched_number)
        xc = x_noisy / (t[:, None, None, None] ** 2 + 1) ** 0.5
        timesteps = (t * 100).clamp(0, 999).float()
        hint = self.hint.expand(x_noisy.shape[0], -1, -1, -1)
        down, mid = self.net(xc, timesteps, cond["c_crossattn"], hint, return_dict=False)
        out = {"input": [], "middle": [mid * self.strength], "output": [d * self.strength for d in down]}
        if prev is not None:
            for key in ("middle", "output"):
                out[key] = [a + b for a, b in zip(out[key], prev[key], strict=True)]
        return out


def _install_controlnet_script(webui, nets: list) -> None:
    """A stand-in of ``sd_forge_controlnet``'s always-on script: before every sampling pass it
    chains ``nets`` on a clone of the UNet patcher and assigns it back, as Forge's does."""
    base = webui.scripts.Script

    class ControlNetScript(base):
        sorting_priority = 10
        filename = "extensions-builtin/sd_forge_controlnet/scripts/controlnet.py"

        def title(self):
            return "ControlNet"

        def process_before_every_sampling(self, p, *args, **kwargs):
            unet = p.sd_model.forge_objects.unet.clone()
            unet.controlnet_linked_list = None
            for net in nets:
                unet.add_patched_controlnet(net)
            p.sd_model.forge_objects.unet = unet

    script = ControlNetScript()
    script.alwayson = True
    script.args_from = script.args_to = 0
    runner = webui.scripts.scripts_txt2img
    runner.alwayson_scripts.insert(0, script)  # before sd-accel's, as its file name sorts first


def _counts(component: str) -> tuple[int, int]:
    from sd_accel.webui.controller import controller

    engines = controller().loaded(component)
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


def test_forge_controlnet_calls_run_on_the_residual_engine(tmp_path, capsys):
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    from sd_accel.webui.jobs import build_for_checkpoint

    webui.txt2img(prompt="a cat", steps=1)  # Forge 2 loads the checkpoint when it generates
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    unet = getattr(unet, "torch_unet", unet).unet  # the stub's diffusers UNet
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    nets = [ForgeControlNet(unet, hint, 2.0, seed=0)]

    def engines_on(on: bool) -> None:
        webui.shared.opts.data["sd_accel_forge_enabled"] = on
        webui.shared.opts.data["sd_accel_vae_clip_enabled"] = on

    def job() -> torch.Tensor:
        return webui.txt2img(prompt="a cat", steps=2).samples

    engines_on(False)
    plain = job()
    _install_controlnet_script(webui, nets)
    reference = job()
    assert (reference - plain).abs().max() > 0.02  # the ControlNet changes the image (10x the tolerance)
    nets[0].strength = 0.5
    half = job()
    assert (half - reference).abs().max() > 0.01
    nets[0].strength = 2.0

    records = build_for_checkpoint(profile=STATIC, components=("unet",))
    engines_on(True)
    capsys.readouterr()
    got = job()  # no residual-taking engine yet: PyTorch, counted, said
    text = capsys.readouterr().out
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    engine_calls, torch_calls = _counts("ldm_unet")
    assert engine_calls == 0 and torch_calls > 0
    assert "ControlNet residuals: no UNet engine that takes them" in text and "unet_control" in text

    records += build_for_checkpoint(profile=STATIC, components=("unet_control",))
    assert records[-1].key.component == "ldm_unet_control" and records[-1].validation["ok"]
    capsys.readouterr()
    got = job()
    text = capsys.readouterr().out
    torch.testing.assert_close(got, reference, **TOL)
    control_calls = _counts("ldm_unet_control")
    assert control_calls[0] >= torch_calls and control_calls[1] == 0, text
    assert _counts("ldm_unet") == (0, 0)
    assert f"UNet with ControlNet residuals calls this job: {control_calls[0]} on engines, 0 in PyTorch" in text

    nets[0].strength = 0.5  # another strength: the same engine
    torch.testing.assert_close(job(), half, **TOL)
    assert _counts("ldm_unet_control")[1] == 0
    nets.append(ForgeControlNet(unet, hint.flip(-1), 0.7, seed=1))  # two chained nets: their sum, same engine
    engines_on(False)
    two = job()
    engines_on(True)
    torch.testing.assert_close(job(), two, **TOL)
    assert _counts("ldm_unet_control")[1] == 0
    assert len({r.key.name for r in records}) == 2  # nothing else was built

    nets.clear()  # no ControlNet: the plain engine again
    torch.testing.assert_close(job(), plain, **TOL)
    assert _counts("ldm_unet")[0] > 0 and _counts("ldm_unet_control") == (0, 0)


def test_forge_controlnet_with_a_lora_refits_the_residual_engine(tmp_path, capsys):
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    from sd_accel.webui.jobs import build_for_checkpoint

    webui.txt2img(prompt="a cat", steps=1)
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    unet = getattr(unet, "torch_unet", unet).unet
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    _install_controlnet_script(webui, [ForgeControlNet(unet, hint, 2.0)])
    records = build_for_checkpoint(profile=STATIC, components=("unet", "unet_control"))
    prompts = {"film": "a cat <lora:film:0.8>", "ink": "a cat <lora:ink:1>"}

    def engines_on(on: bool) -> None:
        webui.shared.opts.data["sd_accel_forge_enabled"] = on
        webui.shared.opts.data["sd_accel_vae_clip_enabled"] = on

    engines_on(False)
    reference = {name: webui.txt2img(prompt=prompt, steps=2).samples for name, prompt in prompts.items()}
    assert (reference["film"] - reference["ink"]).abs().max() > 0.02
    engines_on(True)
    for name, prompt in prompts.items():
        capsys.readouterr()
        got = webui.txt2img(prompt=prompt, steps=2).samples
        text = capsys.readouterr().out
        assert "refitting the residual-taking engine" in text, text
        # every call had residuals: the plain UNet's engine is not refitted for nothing (a real
        # Forge refitted both, 70-100 s and 1.6 GiB more on a CPU), and the job's line names the
        # engine that carries the LoRAs
        assert "refitting the engine of" not in text, text
        assert "ldm_unet_control." in text.split("refitted for ")[-2].split("\n")[-1], text
        torch.testing.assert_close(got, reference[name], **TOL)
        calls = _counts("ldm_unet_control")
        assert calls[0] > 0 and calls[1] == 0, text
    assert len(records) == 2  # LoRAs and strengths by refit, never a build


def _install_a1111_controlnet_hook(webui, net, hint) -> list[int]:
    """A stand-in of sd-webui-controlnet's always-on script: ``process`` hooks the UNet as its
    ``UnetHook.hook`` does (``model._original_forward = model.forward``; ``model.forward =
    forward_webui``, which computes the residuals and runs the UNet's blocks itself, never the
    class's forward where the SD-UNet dispatch sits), ``postprocess`` restores it. Returns the
    list its forward counts calls in."""
    calls: list[int] = []

    def forward_webui(self, x, timesteps=None, context=None, y=None, **kwargs):
        calls.append(x.shape[0])
        down, mid = net(x, timesteps, context, hint.expand(x.shape[0], -1, -1, -1), return_dict=False)
        return self.unet(x, timesteps, encoder_hidden_states=context, down_block_additional_residuals=down,
                         mid_block_additional_residual=mid, return_dict=False)[0]

    class ControlNetScript(webui.scripts.Script):
        filename = "extensions/sd-webui-controlnet/scripts/controlnet.py"

        def title(self):
            return "ControlNet"

        def process(self, p, *args):
            model = p.sd_model.model.diffusion_model
            model._original_forward = model.forward
            model.forward = forward_webui.__get__(model, type(model))

        def postprocess(self, p, processed, *args):
            model = p.sd_model.model.diffusion_model
            if hasattr(model, "_original_forward"):
                model.forward = model._original_forward
                del model._original_forward

    script = ControlNetScript()
    script.alwayson = True
    script.args_from = script.args_to = 0
    webui.scripts.scripts_txt2img.alwayson_scripts.insert(0, script)
    return calls


def test_a1111_controlnet_hook_runs_the_job_in_pytorch_counted_and_said(tmp_path, capsys):
    webui = harness.start(tmp_path, options=EXACT)
    from sd_accel.models.tiny_controlnet import tiny_controlnet
    from sd_accel.webui.jobs import build_for_checkpoint

    unet = webui.shared.sd_model.model.diffusion_model
    skipped: list = []
    build_for_checkpoint(profile=STATIC, components=("unet", "unet_control"), skipped=skipped)
    assert any(s.startswith("unet_control (") and "sd-webui-controlnet" not in s and "Forge" in s
               for s in skipped), skipped  # A1111: no call would reach it, so it is not built
    net = tiny_controlnet(unet.unet, seed=0).eval()
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))

    webui.shared.opts.sd_unet = "Automatic"
    plain = webui.txt2img(prompt="a cat", steps=2).samples
    assert _counts("ldm_unet")[0] > 0
    calls = _install_a1111_controlnet_hook(webui, net, hint)
    webui.shared.opts.sd_unet = "None"
    reference = webui.txt2img(prompt="a cat", steps=2).samples
    assert calls and (reference - plain).abs().max() > 0.02
    webui.shared.opts.sd_unet = "Automatic"
    calls.clear()
    capsys.readouterr()
    got = webui.txt2img(prompt="a cat", steps=2).samples
    text = capsys.readouterr().out
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    assert type(webui.sd_unet.current_unet).__name__ == "SdAccelUnet"
    assert _counts("ldm_unet") == (0, len(calls))
    n = len(calls)
    assert f"UNet calls this job: 0 on engines, {n} in PyTorch ({n}x sd-webui-controlnet's UNet hook" in text
    assert "runs the UNet itself, so no call reaches the engine" in text
    from sd_accel.webui.a1111 import HOOK_MARK

    assert not hasattr(unet.__dict__.get("forward"), HOOK_MARK)  # its restore took our counter away with its hook

    webui.scripts.scripts_txt2img.alwayson_scripts.pop(0)  # no ControlNet unit: engines again
    torch.testing.assert_close(webui.txt2img(prompt="a cat", steps=2).samples, plain, atol=2e-3, rtol=2e-3)
    assert _counts("ldm_unet")[1] == 0


def test_forge_controlnet_refit_leaves_the_plain_unets_idle_refit_out_of_memory(tmp_path, capsys, monkeypatch):
    """A real Forge (SD 1.5, CPU, OpenVINO bf16) peaked 1 GiB above its own PyTorch at the first
    ControlNet job with a LoRA: the residual-taking engine was refitted while the plain UNet's
    refit of the same LoRA (kept from the job before, serving no ControlNet call) stayed loaded.
    Before a UNet engine is refitted for a job (one LoRA set kept refitted per checkpoint: the
    default), the other kind's engines that made no call in it leave memory; later jobs load or
    refit them again and compute what they did."""
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    import sd_accel.refit as refit_module
    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    webui.txt2img(prompt="a cat", steps=1)
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    unet = getattr(unet, "torch_unet", unet).unet
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    nets: list = []
    _install_controlnet_script(webui, nets)
    build_for_checkpoint(profile=STATIC, components=("unet", "unet_control"))
    prompt = "a cat <lora:film:1>"

    def engines_on(on: bool) -> None:
        webui.shared.opts.data["sd_accel_forge_enabled"] = on
        webui.shared.opts.data["sd_accel_vae_clip_enabled"] = on

    def with_control(on: bool) -> None:
        nets[:] = [ForgeControlNet(unet, hint, 2.0)] if on else []

    engines_on(False)
    reference = {}
    for name, control, text in (("plain", False, "a cat"), ("lora", False, prompt), ("lora+cn", True, prompt),
                                ("cn", True, "a cat")):
        with_control(control)
        reference[name] = webui.txt2img(prompt=text, steps=2).samples
    engines_on(True)

    loaded_at_refit: list[list[str]] = []  # per refit: the UNet engines (any kind) loaded beside it
    real = refit_module.refit_engine

    def watched(handle, *args, **kwargs):
        ctl = controller()
        engines = ctl.loaded("ldm_unet") + ctl.loaded("ldm_unet_control")
        loaded_at_refit.append(sorted(h.name for e in engines for h in e.handles
                                      if h is not handle and h.runner is not None
                                      and getattr(h.runner, "done", True)))  # (a PendingRefit not made yet holds nothing)
        return real(handle, *args, **kwargs)

    monkeypatch.setattr(refit_module, "refit_engine", watched)

    def job(name: str, control: bool, text: str, component: str) -> str:
        with_control(control)
        capsys.readouterr()
        got = webui.txt2img(prompt=text, steps=2).samples
        out = capsys.readouterr().out
        torch.testing.assert_close(got, reference[name], **TOL)
        calls = _counts(component)
        assert calls[0] > 0 and calls[1] == 0, (name, out)
        return out

    job("plain", False, "a cat", "ldm_unet")
    assert "refitting the engine of" in job("lora", False, prompt, "ldm_unet")
    assert loaded_at_refit == [[]]  # (the base engine's runner closes as its refit starts)
    out = job("lora+cn", True, prompt, "ldm_unet_control")
    assert "refitting the residual-taking engine" in out
    # the plain UNet's refit served no call of this job: it left memory before this refit
    assert loaded_at_refit[1] == [], loaded_at_refit
    assert controller().refits.engines("ldm_unet") == []
    # and the jobs after it: the plain LoRA is refitted again (never stale), the residual-taking
    # refit leaves memory first; ControlNet without LoRA loads its base engine again
    assert "refitting the engine of" in job("lora", False, prompt, "ldm_unet")
    assert loaded_at_refit[2] == [], loaded_at_refit
    assert controller().refits.engines("ldm_unet_control") == []
    job("cn", True, "a cat", "ldm_unet_control")
    job("plain", False, "a cat", "ldm_unet")
    assert len(loaded_at_refit) == 3
    # no LoRA: the plain base engine that served the job before closes before the residual-taking
    # one serves (a real Forge: 9.16 GiB with it closed, under its PyTorch's 10.22)
    job("cn", True, "a cat", "ldm_unet_control")
    plain = [e for k, e in controller()._engines.items() if e is not None and k[1] == "ldm_unet"]
    assert plain and all(h.runner is None for e in plain for h in e.handles)
    job("plain", False, "a cat", "ldm_unet")  # loaded again from the cache


def test_forge_controlnet_from_a_later_step_keeps_the_plain_refit_that_served_the_job(tmp_path, capsys):
    """A ControlNet that starts at a later step (Forge's ``guidance_start``: no residuals before
    it): the job's first calls run on the plain UNet's refit, the later ones on the residual-taking
    engine's. The plain refit served this job, so it stays loaded while the other is refitted
    (a job never refits the same engine twice) and both compute what PyTorch does."""
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    webui.txt2img(prompt="a cat", steps=1)
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    unet = getattr(unet, "torch_unet", unet).unet
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))

    class LateControlNet(ForgeControlNet):
        calls = 0

        def get_control(self, x_noisy, t, cond, batched_number):
            self.calls += 1
            return None if self.calls <= 2 else super().get_control(x_noisy, t, cond, batched_number)

    net = LateControlNet(unet, hint, 2.0)
    _install_controlnet_script(webui, [net])
    build_for_checkpoint(profile=STATIC, components=("unet", "unet_control"))
    prompt = "a cat <lora:film:1>"

    def job() -> torch.Tensor:
        net.calls = 0
        return webui.txt2img(prompt=prompt, steps=3).samples

    webui.shared.opts.data["sd_accel_forge_enabled"] = False
    reference = job()
    webui.shared.opts.data["sd_accel_forge_enabled"] = True
    capsys.readouterr()
    got = job()
    text = capsys.readouterr().out
    torch.testing.assert_close(got, reference, **TOL)
    plain, control = _counts("ldm_unet"), _counts("ldm_unet_control")
    assert plain[0] > 0 and control[0] > 0 and plain[1] == control[1] == 0, text
    assert "refitting the engine of" in text and "refitting the residual-taking engine" in text, text
    assert [e for e in controller().refits.engines("ldm_unet")], "the plain refit that served the job was dropped"
    capsys.readouterr()
    torch.testing.assert_close(job(), reference, **TOL)  # the next job: both kept, nothing refitted
    assert "refitting" not in capsys.readouterr().out
