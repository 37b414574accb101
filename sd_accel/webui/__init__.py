"""sd-accel inside AUTOMATIC1111's and Forge's Stable Diffusion WebUI.

The WebUI's script (``extension/scripts/sd_accel_webui.py``) is thin: it registers callbacks
and a ``scripts.Script`` and hands every call to this package, which is kept testable against
the stand-in WebUI in ``tests/webui_stub``:

- :mod:`.host`: the one place that imports the WebUI's modules (``modules.shared`` ...);
- :mod:`.identity`: which weights a job needs (checkpoint hash plus merged LoRAs);
- :mod:`.export`: build engines from the loaded model's modules (jobs for :func:`sd_accel.build.run_jobs`);
- :mod:`.tracing`: the WebUI's run-time patches of a module undone for a trace (an export, a
  refit's validation) and restored after;
- :mod:`.runner`: per-call engine choice with batch chunks and the PyTorch fallback;
- :mod:`.controller`: settings, cache, engines per checkpoint, per-job reports;
- :mod:`.a1111` (SD-UNet option) and :mod:`.forge` (UNet patcher): the two ways in;
- :mod:`.jobs`: the always-on script's hooks (job start, batch, sampling pass, job end) and
  builds by checkpoint;
- :mod:`.tab`, :mod:`.settings`, :mod:`.api`: the tab, the settings page and the HTTP routes;
- :mod:`.callbacks`: what the extension's script registers with ``script_callbacks``.
"""
