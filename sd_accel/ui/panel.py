"""The sd-accel Gradio panel: Generate, Engines and Settings tabs in one ``gr.Blocks``.

Used by the standalone app (:mod:`sd_accel.ui.app`) and by the WebUI tab, so it sticks to
Gradio API that means the same on 3.41 (A1111), 4.x (Forge) and 6.x: plain components,
``.click(fn, inputs, outputs)``, ``.then``, ``gr.update(...)`` for new dropdown choices,
generators for live progress, ``show_progress="minimal"``, ``queue=False`` for quick events.
No themes, CSS, sidebars or per-version ``Component.update`` methods. The logic lives in
:mod:`sd_accel.ui.state`; these handlers only turn widget values into its requests and its
results into widget values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from sd_accel.config import ATTENTION, BACKENDS, OFFLOAD, PRECISION
from sd_accel.preview import PREVIEW_MODES, Preview
from sd_accel.profiles import PRESETS, RANGE_GRAMMAR, default_preset
from sd_accel.ui.state import (
    BUILD_PRECISIONS,
    CUSTOM_PRESET,
    DEFAULT_MODEL,
    ENGINE_HEADERS,
    ENGINE_MODES,
    BuildRequest,
    BuildUpdate,
    Busy,
    GenerateRequest,
    PanelState,
    engine_names,
    preset_fields,
    profile_from_fields,
)

DEFAULT_SAMPLER_LABEL = "default (the model's scheduler)"
# On by default: latent2rgb is a 4x3 matrix product on the latents (~2 ms at 512 px), TAESD a
# small share of the UNet steps between two previews (1.6 s at 512 px on one CPU thread, measured);
# "off" saves even that, and the images sent to the browser.
DEFAULT_PREVIEW = "auto"
_USER_ERRORS = (Busy, ValueError, RuntimeError, FileNotFoundError, OSError)


def _sampler_choices() -> list[str]:
    from sd_accel.samplers import list_presets

    return [DEFAULT_SAMPLER_LABEL, *list_presets(available_only=True)]


def _event_kwargs(listener: Callable, heavy: bool) -> dict[str, Any]:
    """Keyword arguments an event listener takes on this Gradio version.

    Heavy events (build, generate) share one concurrency group of size 1 on Gradio >= 4, whose
    queue otherwise gives each function its own group; 3.x's ``queue(concurrency_count=1)``
    already runs one event at a time. Quick events skip the queue (``queue=False``, all
    versions) so that Cancel, Refresh and Delete answer while a build runs.
    """
    params = inspect.signature(listener).parameters
    if not heavy:
        return {"queue": False}
    out: dict[str, Any] = {"show_progress": "minimal"}
    if "concurrency_id" in params:
        out.update(concurrency_id="sd_accel_heavy", concurrency_limit=1)
    return out


def _progress_markdown(update: BuildUpdate) -> str:
    """A text progress bar plus the update's text (Markdown renders the same on every version)."""
    if update.done:
        return update.text
    filled = int(round(update.fraction * 20))
    return f"`{'█' * filled}{'░' * (20 - filled)}` {update.fraction * 100:.0f}%\n\n{update.text}"


def _engine_table(state: PanelState):
    import pandas as pd  # a Gradio dependency; a DataFrame keeps the headers when there are no rows

    return pd.DataFrame(state.engine_rows(), columns=ENGINE_HEADERS)


def _engine_outputs(state: PanelState) -> tuple[Any, ...]:
    """Table, picker choices and disk line, freshly read from the cache (and the status box's
    text, when the state has one)."""
    cache = state.cache()
    out = (_engine_table(state), gr.update(choices=engine_names(cache), value=None), state.disk_usage())
    return (*out, state.status() or "") if _has_status(state) else out


def _has_status(state: PanelState) -> bool:
    return type(state).status is not PanelState.status


def build_panel(state: PanelState | None = None) -> gr.Blocks:
    """The panel as a ``gr.Blocks``; ``state`` holds the settings and loaded pipelines.

    (Skipped in the test suite: launch() serves until stopped; tests/test_ui_browser.py drives the
    panel in a browser.)

    >>> demo = build_panel(PanelState(engine_dir="/tmp/engines"))    # doctest: +SKIP
    >>> demo.queue().launch()                                           # doctest: +SKIP
    """
    state = state or PanelState()
    with gr.Blocks(title="sd-accel") as demo:
        status = None
        if _has_status(state):
            # Filled on page load (never while the UI is built: a host's status may need its model)
            status = gr.Markdown("Reading the status...", elem_id="sd-accel-status")
        else:
            gr.Markdown("## sd-accel\nFaster Stable Diffusion: engines (TensorRT, ONNX Runtime), "
                        "attention, precision and sampler presets.")
        with gr.Row(visible=state.show_model):
            model = gr.Textbox(value=state.model or DEFAULT_MODEL, label="Model", visible=state.show_model,
                               placeholder="a .safetensors checkpoint, a diffusers folder, or builtin:tiny-sd15",
                               scale=3, elem_id="sd-accel-model")
            # Beside the model: generation decodes with it, and builds make its VAE engines.
            tiny_vae = gr.Textbox(value="", label="Tiny VAE (TAESD): empty = the model's own VAE",
                                  visible=state.show_model, scale=2, elem_id="sd-accel-tiny-vae",
                                  placeholder="taesd_decoder.safetensors (taesdxl_ for SDXL) or a TAESD folder")
        gen_precision = None
        if state.show_generate:
            with gr.Tab("Generate", elem_id="sd-accel-tab-generate"):
                gen_precision = _generate_tab(state, model, tiny_vae)
        with gr.Tab("Engines", elem_id="sd-accel-tab-engines"):
            eng = _engines_tab(state, model, tiny_vae, status)
        with gr.Tab("Settings", elem_id="sd-accel-tab-settings"):
            _settings_tab(state, gen_precision, eng)
        demo.load(lambda: _engine_outputs(state), None, eng["listing"], **_event_kwargs(demo.load, heavy=False))
    return demo


def _preview_report(preview: Preview) -> str:
    return f"Sampling: step {preview.step} of {preview.steps} (preview: {preview.decoder})"


def _generate_tab(state: PanelState, model: gr.Textbox, tiny_vae: gr.Textbox) -> gr.Dropdown:
    """Lay out the Generate tab and wire its button; returns the precision dropdown (Settings sets it)."""
    with gr.Row():
        with gr.Column(scale=3):
            prompt = gr.Textbox(value="a photo of a cat", label="Prompt", lines=2, elem_id="sd-accel-prompt")
            negative = gr.Textbox(value="", label="Negative prompt", lines=1, elem_id="sd-accel-negative")
            with gr.Row():
                sampler = gr.Dropdown(_sampler_choices(), value="DPM++ 2M Karras", label="Sampler",
                                      elem_id="sd-accel-sampler")
                steps = gr.Slider(1, 150, value=20, step=1, label="Steps", elem_id="sd-accel-steps")
                cfg = gr.Slider(0.0, 30.0, value=7.0, step=0.5, label="CFG scale", elem_id="sd-accel-cfg")
                preview = gr.Dropdown(list(PREVIEW_MODES), value=DEFAULT_PREVIEW, label="Live preview",
                                      info="auto: tiny VAE if set, else latent2rgb", elem_id="sd-accel-preview")
            with gr.Row():
                width = gr.Slider(64, 2048, value=512, step=8, label="Width", elem_id="sd-accel-width")
                height = gr.Slider(64, 2048, value=512, step=8, label="Height", elem_id="sd-accel-height")
                batch = gr.Slider(1, 8, value=1, step=1, label="Batch", elem_id="sd-accel-batch")
                seed = gr.Number(value=0, precision=0, label="Seed", elem_id="sd-accel-seed")
            with gr.Row():
                attention = gr.Dropdown(list(ATTENTION), value="auto", label="Attention",
                                        elem_id="sd-accel-attention")
                precision = gr.Dropdown(list(PRECISION), value=state.precision, label="Precision",
                                        elem_id="sd-accel-precision")
                offload = gr.Dropdown(list(OFFLOAD), value="none", label="Offload", elem_id="sd-accel-offload")
                # auto: a size no engine covers gets one built first (cached); cached: only built ones
                use_engines = gr.Dropdown(list(ENGINE_MODES), value="auto", label="Engines (auto: build on first use)",
                                          elem_id="sd-accel-use-engines")
            units = _control_units()
            button = gr.Button("Generate", variant="primary", elem_id="sd-accel-generate")
        with gr.Column(scale=2):
            gallery = gr.Gallery(label="Images", columns=2, height=400, elem_id="sd-accel-gallery")
            report = gr.Markdown("", elem_id="sd-accel-report")

    def on_generate(model_text, prompt_text, negative_text, sampler_name, n_steps, cfg_scale, w, h, n,
                    seed_value, attention_name, precision_name, offload_name, engines_on, tiny_vae_text,
                    preview_mode, *unit_values) -> Iterator[tuple[list, str]]:
        # The numbers go as the widgets give them: GenerationParams (through state.generate)
        # is the one place that checks them, with the same messages as the CLI.
        req = GenerateRequest(
            prompt=prompt_text or "", negative_prompt=negative_text or "",
            model=(model_text or "").strip() or DEFAULT_MODEL,
            sampler=None if sampler_name in (None, "", DEFAULT_SAMPLER_LABEL) else sampler_name,
            steps=n_steps, cfg=cfg_scale, width=w, height=h, batch=n,
            seed=0 if seed_value is None else seed_value, attention=attention_name, precision=precision_name,
            offload=offload_name, engines=engines_on if isinstance(engines_on, bool) else (engines_on or "off"),
            tiny_vae=tiny_vae_text or None, preview=preview_mode or "off",
            controlnets=_units_in_use(unit_values),
        )
        try:
            for item in state.generate_stream(req):
                if isinstance(item, Preview):
                    yield item.images, _preview_report(item)
                else:
                    yield item.images, item.report()
        except _USER_ERRORS as exc:  # shown in the report, not as a stack trace
            yield [], f"**Error**: {exc}"

    inputs = [model, prompt, negative, sampler, steps, cfg, width, height, batch, seed, attention, precision,
              offload, use_engines, tiny_vae, preview, *units]
    button.click(on_generate, inputs, [gallery, report], **_event_kwargs(button.click, heavy=True))
    # (on each edit: cheap once sd_accel.api is imported; a name half typed changes nothing)
    model.change(model_defaults, [model], [steps, cfg, width, height, sampler], **_event_kwargs(model.change, heavy=False))
    return precision


def model_defaults(model_text: str | None) -> tuple:
    """Updates for the Steps, CFG, Width, Height and Sampler widgets when the model changes: its
    family's own (SD3.5 and FLUX.1: 1024 px and their steps and guidance; their flow-matching
    sampler is the model's own). No change where the family cannot be told without loading."""
    from sd_accel.api import generation_defaults, model_family

    family = model_family((model_text or "").strip() or DEFAULT_MODEL)
    if family is None:
        return (gr.update(),) * 5
    values = generation_defaults(family)
    side = PRESETS[default_preset(family)].height[0]
    flow = family.startswith(("sd3", "flux"))
    return (gr.update(value=values["steps"]), gr.update(value=values["cfg"]), gr.update(value=side),
            gr.update(value=side), gr.update(value=DEFAULT_SAMPLER_LABEL) if flow else gr.update())


CONTROL_UNITS = 2  # units shown in the Generate tab; more nets: the CLI, the API, the service
_UNIT_FIELDS = 6  # model, image, preprocessor, weight, start, end


def _control_units() -> list[Any]:
    """The ControlNet units' widgets, :data:`_UNIT_FIELDS` per unit, in one closed accordion."""
    from sd_accel.ui.state import CONTROL_PREPROCESSORS

    widgets: list[Any] = []
    with gr.Accordion("ControlNet", open=False, elem_id="sd-accel-controlnet"):
        for i in range(1, CONTROL_UNITS + 1):
            with gr.Row():
                with gr.Column(scale=2):
                    net = gr.Textbox(value="", label=f"ControlNet {i}: file or folder (empty: off)",
                                     placeholder="control_v11p_sd15_canny.safetensors or a diffusers folder",
                                     elem_id=f"sd-accel-cn{i}-model")
                    with gr.Row():
                        prep = gr.Dropdown(list(CONTROL_PREPROCESSORS), value="none", label="Preprocessor",
                                           elem_id=f"sd-accel-cn{i}-preprocess")
                        weight = gr.Slider(0.0, 2.0, value=1.0, step=0.05, label="Weight",
                                           elem_id=f"sd-accel-cn{i}-weight")
                    with gr.Row():
                        start = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Start",
                                          elem_id=f"sd-accel-cn{i}-start")
                        end = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="End", elem_id=f"sd-accel-cn{i}-end")
                image = gr.Image(type="pil", label=f"Control image {i}", height=200, elem_id=f"sd-accel-cn{i}-image")
            widgets += [net, image, prep, weight, start, end]
    return widgets


def _units_in_use(values: tuple) -> tuple:
    """ControlUnits of the units with a ControlNet or an image (a unit with one only is refused by
    its check, with what is missing)."""
    from sd_accel.ui.state import ControlUnit

    out = []
    for i in range(0, len(values), _UNIT_FIELDS):
        net, image, prep, weight, start, end = values[i:i + _UNIT_FIELDS]
        if (net or "").strip() or image is not None:
            out.append(ControlUnit(model=(net or "").strip(), image=image, preprocess=prep or "none",
                                   scale=1.0 if weight is None else weight, start=0.0 if start is None else start,
                                   end=1.0 if end is None else end))
    return tuple(out)


def _engines_tab(state: PanelState, model: gr.Textbox, tiny_vae: gr.Textbox, status: Any = None) -> dict[str, Any]:
    """Lay out the Engines tab and wire it; returns the components other tabs update."""
    first = getattr(state, "default_preset", None) or default_preset("sd15")
    with gr.Row():
        with gr.Column(scale=3):
            preset = gr.Dropdown([*PRESETS, CUSTOM_PRESET], value=first, label="Preset (fills the ranges below)",
                                 elem_id="sd-accel-preset")
            b, h, w, t = preset_fields(first)
            gr.Markdown(f"Each range: {RANGE_GRAMMAR}.", elem_id="sd-accel-range-hint")
            with gr.Row():
                r_batch = gr.Textbox(b, label="Batch (images per prompt)", placeholder="1-4",
                                     elem_id="sd-accel-range-batch")
                r_height = gr.Textbox(h, label="Height (px)", placeholder="512-768", elem_id="sd-accel-range-height")
                r_width = gr.Textbox(w, label="Width (px)", placeholder="512-768", elem_id="sd-accel-range-width")
                r_tokens = gr.Textbox(t, label="Tokens (77 per chunk)", placeholder="77-154",
                                      elem_id="sd-accel-range-tokens")
            with gr.Row():
                backend = gr.Dropdown(list(BACKENDS), value=state.backend, label="Backend",
                                      elem_id="sd-accel-backend")
                precision = gr.Dropdown(list(BUILD_PRECISIONS), value=state.build_precision(),
                                        label="Engine precision", elem_id="sd-accel-build-precision")
            components = gr.CheckboxGroup(list(state.component_choices), value=list(state.default_components),
                                          label=state.components_label, elem_id="sd-accel-components")
            with gr.Row():
                build = gr.Button("Build engines", variant="primary", elem_id="sd-accel-build")
                cancel = gr.Button("Cancel build", variant="stop", elem_id="sd-accel-cancel")
        with gr.Column(scale=2):
            progress = gr.Markdown("No build running.", elem_id="sd-accel-build-progress")
    gr.Markdown("### Engines on disk")
    table = gr.Dataframe(headers=ENGINE_HEADERS, value=_engine_table(state), interactive=False, wrap=True,
                         label="Engines", elem_id="sd-accel-engines")
    disk = gr.Markdown(state.disk_usage(), elem_id="sd-accel-disk")
    with gr.Row():
        name = gr.Dropdown(engine_names(state.cache()), value=None, label="Engine (for Delete / Rebuild)",
                           scale=4, elem_id="sd-accel-engine-name")
        delete = gr.Button("Delete", variant="stop", scale=1, elem_id="sd-accel-delete")
        rebuild = gr.Button("Rebuild", scale=1, elem_id="sd-accel-rebuild")
        refresh = gr.Button("Refresh", scale=1, elem_id="sd-accel-refresh")
    action = gr.Markdown("", elem_id="sd-accel-engine-action")
    listing = [table, name, disk] + ([status] if status is not None else [])

    def on_build(model_text, tiny_vae_text, *fields_and_choices) -> Iterator[str]:
        *ranges, backend_name, precision_name, picked = fields_and_choices
        try:
            profile = profile_from_fields(*ranges)
        except ValueError as exc:
            yield f"**Cannot build**: {exc}"
            return
        req = BuildRequest(profile=profile, model=(model_text or "").strip() or DEFAULT_MODEL,
                           components=tuple(picked or ()), backend=backend_name, precision=precision_name,
                           vae=tiny_vae_text or None)
        for update in state.build(req):
            yield _progress_markdown(update)

    def on_rebuild(model_text, tiny_vae_text, engine_name) -> Iterator[str]:
        if not engine_name:
            yield "Pick an engine to rebuild first."
            return
        for update in state.rebuild(engine_name, (model_text or "").strip() or DEFAULT_MODEL, tiny_vae_text or None):
            yield _progress_markdown(update)

    def on_delete(engine_name):
        try:
            message = state.delete(engine_name)
        except _USER_ERRORS as exc:
            message = f"**Cannot delete**: {exc}"
        return (message, *_engine_outputs(state))

    quick = _event_kwargs(refresh.click, heavy=False)
    heavy = _event_kwargs(build.click, heavy=True)
    def on_preset(preset_name):
        if preset_name not in PRESETS:  # cleared or "custom": keep the ranges as they are
            return tuple(gr.update() for _ in range(4))
        return preset_fields(preset_name)

    def on_range(preset_name, *fields):
        # Ranges that no longer match the preset make it "custom" (a preset's own fill matches it).
        if preset_name in PRESETS and tuple(f.strip() for f in fields) != preset_fields(preset_name):
            return CUSTOM_PRESET
        return gr.update()

    ranges = [r_batch, r_height, r_width, r_tokens]
    preset.change(on_preset, preset, ranges, **quick)
    for box in ranges:
        box.change(on_range, [preset, *ranges], preset, **quick)
    build_inputs = [model, tiny_vae, r_batch, r_height, r_width, r_tokens, backend, precision, components]
    def after_build():  # the table changed; an old "Cancelling..." line no longer applies
        return ("", *_engine_outputs(state))

    build.click(on_build, build_inputs, progress, **heavy).then(after_build, None, [action, *listing], **quick)
    cancel.click(state.cancel_build, None, action, **quick)
    rebuild.click(on_rebuild, [model, tiny_vae, name], progress, **heavy).then(
        after_build, None, [action, *listing], **quick)
    delete.click(on_delete, name, [action, *listing], **quick)
    refresh.click(lambda: _engine_outputs(state), None, listing, **quick)
    return {"table": table, "name": name, "disk": disk, "backend": backend, "precision": precision,
            "listing": listing}


def _settings_tab(state: PanelState, gen_precision: gr.Dropdown, eng: dict[str, Any]) -> None:
    """Lay out the Settings tab; Save applies to the state and to the other tabs' defaults."""
    gr.Markdown("Defaults for this app: builds and generation use them until changed here. "
                "Engines are only ever loaded on the backend version and GPU/CPU class they were built for.")
    engine_dir = gr.Textbox(value=str(state.cache().root), label="Engine directory",
                            elem_id="sd-accel-engine-dir")
    with gr.Row():
        backend = gr.Dropdown(list(BACKENDS), value=state.backend, label="Default backend",
                              elem_id="sd-accel-default-backend")
        precision = gr.Dropdown(list(PRECISION), value=state.precision, label="Default precision",
                                elem_id="sd-accel-default-precision")
    save = gr.Button("Save settings", variant="primary", elem_id="sd-accel-save-settings")
    status = gr.Markdown("", elem_id="sd-accel-settings-status")

    def on_save(dir_text, backend_name, precision_name):
        try:
            message = state.apply_settings(dir_text, backend_name, precision_name)
        except _USER_ERRORS as exc:
            message = f"**Not saved**: {exc}"
        answer = (message, state.precision, state.backend, state.build_precision(), *_engine_outputs(state))
        return answer if gen_precision is not None else (answer[0], *answer[2:])

    outputs = [status, gen_precision, eng["backend"], eng["precision"], *eng["listing"]]
    outputs = [o for o in outputs if o is not None]
    save.click(on_save, [engine_dir, backend, precision], outputs, **_event_kwargs(save.click, heavy=False))
