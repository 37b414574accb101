"""``modules/ui.py``'s ``create_ui``, reduced to what extensions feed: settings and extension tabs.

Settings: ``script_callbacks.ui_settings_callback()`` runs first, then each option gets its
component (``OptionInfo.component(label=..., value=..., **component_args)``, else one by type).
Tabs: ``ui_tabs_callback()`` results are rendered in ``gr.TabItem(label, id=ifid,
elem_id=f"tab_{ifid}")`` with ``interface.render()``, as the WebUI does.
"""

from __future__ import annotations

import gradio as gr

from modules import script_callbacks, shared


def create_setting_component(key):
    info = shared.opts.data_labels[key]
    value = shared.opts.data.get(key, info.default)
    args = dict(info.component_args or {})
    if info.component is not None:
        component = info.component
    elif isinstance(value, bool):
        component = gr.Checkbox
    elif isinstance(value, (int, float)):
        component = gr.Number
    else:
        component = gr.Textbox
    return component(label=info.label, value=value, elem_id=f"setting_{key}", **args)


def create_ui():
    script_callbacks.ui_settings_callback()
    interfaces = script_callbacks.ui_tabs_callback()
    settings = {}
    with gr.Blocks(analytics_enabled=False, title="Stable Diffusion") as demo:
        with gr.Tabs(elem_id="tabs"):
            with gr.TabItem("txt2img", id="txt2img", elem_id="tab_txt2img"):
                gr.Textbox(label="Prompt", elem_id="txt2img_prompt")
            for interface, label, ifid in interfaces:
                with gr.TabItem(label, id=ifid, elem_id=f"tab_{ifid}"):
                    interface.render()
            with gr.TabItem("Settings", id="settings", elem_id="tab_settings"):
                for key, info in shared.opts.data_labels.items():
                    if info.section is not None:
                        settings[key] = create_setting_component(key)
    demo.sd_stub_settings = settings
    demo.sd_stub_tabs = [(label, ifid) for _, label, ifid in interfaces]
    return demo
