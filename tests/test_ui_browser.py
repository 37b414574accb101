"""The standalone app in a real browser (Debian's chromium via Playwright): build engines for the
tiny model, generate on them, delete one. Screenshots of each tab go to ``test-artifacts/``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUILD_TIMEOUT_MS = 120_000  # three tiny engines take 10-20 s here; slow CI machines get headroom
STEP_TIMEOUT_MS = 30_000

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the app did not answer on {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The app in a subprocess on a free local port, with its own empty engine dir; killed after."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium package (apt-get install chromium)")
    ARTIFACTS.mkdir(exist_ok=True)
    engine_dir = tmp_path_factory.mktemp("ui-engines")
    port = _free_port()
    log = ARTIFACTS / "ui-server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "SD_ACCEL_ENGINE_DIR": str(engine_dir)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sd_accel.ui.app", "--port", str(port), "--engine-dir", str(engine_dir)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_until_up(url, proc, log)
        yield url, engine_dir
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def page(app):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(STEP_TIMEOUT_MS)
            pg.goto(app[0])
            pg.wait_for_selector("#sd-accel-generate")
            yield pg
        finally:
            browser.close()


# The helpers below find widgets on Gradio 6 (the dev venv) and, as a portability check, on
# 3.41 too: there tabs are plain buttons, rows plain <tr>s and dropdown options <li>s.


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).or_(page.locator(".tab-nav button", has_text=name)).first.click()


def _set_slider(page, elem_id: str, value: int) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


# The table's data rows. Gradio 6 draws a virtual grid (role=row holding role=gridcell cells);
# 3.41 and 4.x draw <tr>s, and 4.x first draws a hidden sizing table, so take the last table.
_ROWS_JS = """(root) => {
  let rows = [...root.querySelectorAll('[role=row]')].filter(r => r.querySelector('[role=gridcell]'));
  if (!rows.length) {
    const tables = [...root.querySelectorAll('table')].filter(t => t.querySelector('tbody tr'));
    rows = tables.length ? [...tables[tables.length - 1].querySelectorAll('tbody tr')] : [];
  }
  return rows.map(r => r.innerText);
}"""


def _engine_rows(page, expected: int) -> list[str]:
    """The table's data rows as text, polled until there are ``expected`` of them."""
    deadline = time.monotonic() + STEP_TIMEOUT_MS / 1000
    while True:
        texts = [" ".join(t.split()) for t in page.locator("#sd-accel-engines").first.evaluate(_ROWS_JS)]
        texts = [t for t in texts if t]
        if len(texts) == expected or time.monotonic() > deadline:
            assert len(texts) == expected, texts
            return texts
        time.sleep(0.25)


def _range_box(page, dim: str):
    return page.locator(f"#sd-accel-range-{dim} textarea, #sd-accel-range-{dim} input").first


def _small_torch_run(page) -> None:
    """The Generate tab set for a quick run in torch: 64 px, 2 steps, engines off (no build)."""
    _tab(page, "Generate")
    _set_slider(page, "sd-accel-width", 64)
    _set_slider(page, "sd-accel-height", 64)
    _set_slider(page, "sd-accel-steps", 2)
    page.locator("#sd-accel-use-engines input").click()
    page.get_by_role("option", name="off").or_(page.locator("#sd-accel-use-engines li", has_text="off")).first.click()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_build_generate_delete_in_browser(app, page):
    from playwright.sync_api import expect

    progress = page.locator("#sd-accel-build-progress").first
    _tab(page, "Engines")
    expect(page.locator("#sd-accel-disk").first).to_contain_text("0 engines")

    # The range boxes speak the CLI's grammar: a dynamic preset fills them as MIN-MAX, and a
    # range in another form is refused with the grammar, before anything is built.
    expect(page.locator("#sd-accel-range-hint").first).to_contain_text("MIN-OPT-MAX")
    page.locator("#sd-accel-preset input").click()
    page.get_by_role("option", name="dynamic-512-768").or_(
        page.locator("#sd-accel-preset li", has_text="dynamic-512-768")).first.click()
    expect(_range_box(page, "height")).to_have_value("512-768")
    expect(_range_box(page, "batch")).to_have_value("1-4")
    _range_box(page, "height").fill("64, 64, 64")
    page.locator("#sd-accel-build").click()
    expect(progress).to_contain_text("Cannot build")
    expect(progress).to_contain_text("MIN-OPT-MAX")
    for dim, value in (("batch", "1"), ("height", "64"), ("width", "64"), ("tokens", "77")):
        _range_box(page, dim).fill(value)

    # Cancel while it runs: the Cancel event must get through while the build holds the queue.
    page.locator("#sd-accel-build").click()
    expect(progress).to_contain_text("Engine 1 of 3", timeout=BUILD_TIMEOUT_MS)
    page.locator("#sd-accel-cancel").click()
    expect(progress).to_contain_text("Cancelled", timeout=BUILD_TIMEOUT_MS)
    # On a busy machine an engine may finish before the cancel lands: those are listed and kept,
    # the one in progress is not.
    kept = progress.inner_text().count(": done")
    expect(page.locator("#sd-accel-disk").first).to_contain_text("1 engine," if kept == 1 else f"{kept} engines")

    # The real build: live progress (a percentage) first, then the table fills.
    page.locator("#sd-accel-build").click()
    expect(progress).to_contain_text("%", timeout=BUILD_TIMEOUT_MS)
    expect(progress).to_contain_text("Done", timeout=BUILD_TIMEOUT_MS)
    expect(progress).to_contain_text("clip2")  # ticked, but SD 1.5 has none: said so
    expect(page.locator("#sd-accel-disk").first).to_contain_text("3 engines")
    rows = _engine_rows(page, 6)  # 3 engines, and the 3 ONNX exports they were built from
    exports = [r for r in rows if "ONNX export" in r]
    rows = [r for r in rows if "ONNX export" not in r]
    assert sorted(r.split()[0] for r in rows) == ["clip", "unet", "vae_decoder"], rows
    assert sorted(r.split()[0] for r in exports) == ["clip", "unet", "vae_decoder"], exports
    assert all("static.b1.h64.w64.t77" in r for r in rows), rows
    _shot(page, "ui-engines.png")

    _tab(page, "Generate")
    _set_slider(page, "sd-accel-width", 64)
    _set_slider(page, "sd-accel-height", 64)
    _set_slider(page, "sd-accel-steps", 2)
    report = page.locator("#sd-accel-report").first
    # A bad number is refused by GenerationParams and shown in the report, not as a stack trace.
    seed = page.locator("#sd-accel-seed input").first
    seed.fill("-2")
    seed.press("Tab")
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("GenerationParams.seed=-2 is not valid", timeout=BUILD_TIMEOUT_MS)
    seed.fill("0")
    seed.press("Tab")
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("it/s", timeout=BUILD_TIMEOUT_MS)
    for component, calls in (("clip", 2), ("unet", 2), ("vae_decoder", 1)):
        expect(report.locator("tr", has_text=component).first).to_contain_text(f"engine ({calls} call")
    expect(page.locator("#sd-accel-gallery img").first).to_be_visible()
    _shot(page, "ui-generate.png")

    _tab(page, "Engines")
    unet = next(r for r in rows if r.startswith("unet")).split()[-1]
    page.locator("#sd-accel-engine-name input").click()
    page.get_by_role("option", name=unet).or_(page.locator("#sd-accel-engine-name li", has_text=unet)).first.click()
    page.locator("#sd-accel-delete").click()
    expect(page.locator("#sd-accel-engine-action").first).to_contain_text("Deleted")
    expect(page.locator("#sd-accel-disk").first).to_contain_text("2 engines")
    rows = _engine_rows(page, 4)  # the unet's export went with it: no engine needs it
    assert sorted(r.split()[0] for r in rows) == ["clip", "clip", "vae_decoder", "vae_decoder"], rows
    _shot(page, "ui-engines-after-delete.png")

    _tab(page, "Settings")
    engine_dir = page.locator("#sd-accel-engine-dir textarea, #sd-accel-engine-dir input").first
    expect(engine_dir).to_have_value(str(app[1]))
    _shot(page, "ui-settings.png")


def test_tiny_vae_field_in_browser(app, page, tmp_path_factory):
    """The Tiny VAE (TAESD) field: a bad path is an error in the report, a good one decodes the image
    (engines off: torch, no build)."""
    from playwright.sync_api import expect

    from support.taesd_files import tiny_autoencoder, write_layouts

    taesd = write_layouts(tiny_autoencoder(), tmp_path_factory.mktemp("ui-taesd"))["single"]
    _small_torch_run(page)
    field = page.locator("#sd-accel-tiny-vae textarea, #sd-accel-tiny-vae input").first
    report = page.locator("#sd-accel-report").first
    field.fill(str(taesd.parent / "missing.safetensors"))
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("The Tiny VAE (TAESD) field", timeout=BUILD_TIMEOUT_MS)
    expect(report).to_contain_text("no such file or folder")
    field.fill(str(taesd))
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("Decoded with the tiny VAE (TAESD)", timeout=BUILD_TIMEOUT_MS)
    expect(report).to_contain_text("it/s")
    expect(page.locator("#sd-accel-gallery img").first).to_be_visible()
    _shot(page, "ui-generate-tiny-vae.png")


def test_controlnet_unit_in_browser(app, page, tmp_path_factory):
    """A ControlNet unit: its file and an uploaded hint image reach the run (the report names the net;
    engines off: torch, no build), and a unit with a net but no image is an error in the report."""
    import numpy as np
    from PIL import Image
    from playwright.sync_api import expect

    from sd_accel import load_pipeline
    from sd_accel.models.tiny_controlnet import tiny_controlnet

    from support.controlnet_layout import save_controlnet_file

    folder = tmp_path_factory.mktemp("ui-cn")
    net = save_controlnet_file(tiny_controlnet(load_pipeline("builtin:tiny-sd15").unet), folder / "cn.safetensors")
    hint = folder / "hint.png"
    Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8")).save(hint)

    _small_torch_run(page)
    page.locator("#sd-accel-tiny-vae textarea, #sd-accel-tiny-vae input").first.fill("")
    page.locator("#sd-accel-controlnet").get_by_text("ControlNet", exact=True).first.click()  # open the accordion
    field = page.locator("#sd-accel-cn1-model textarea, #sd-accel-cn1-model input").first
    expect(field).to_be_visible()
    page.wait_for_timeout(500)  # (the accordion's children render as it opens: a fill before lands nowhere)
    field.fill(str(net))
    expect(field).to_have_value(str(net))
    report = page.locator("#sd-accel-report").first
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("has no control image", timeout=BUILD_TIMEOUT_MS)
    page.locator("#sd-accel-cn1-image input[type=file]").first.set_input_files(str(hint))
    _set_slider(page, "sd-accel-cn1-weight", 1)
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("cn.safetensors (none, weight 1, steps 0-1)", timeout=BUILD_TIMEOUT_MS)
    expect(report).to_contain_text("ControlNet")
    expect(report).to_contain_text("it/s")
    expect(page.locator("#sd-accel-gallery img").first).to_be_visible()
    _shot(page, "ui-generate-controlnet.png")


def test_flux_model_takes_its_family_defaults_and_generates_in_browser(app, page):
    """Typing a FLUX.1 model sets its own steps, guidance, size and sampler (its flow-matching
    scheduler); it then generates, its transformer's calls counted in the report."""
    from playwright.sync_api import expect

    _tab(page, "Generate")
    model = page.locator("#sd-accel-model textarea, #sd-accel-model input").first
    model.fill("builtin:tiny-flux")
    # (the first answer imports the library in the app process: seconds)
    expect(page.locator("#sd-accel-steps input[type=number]")).to_have_value("4", timeout=BUILD_TIMEOUT_MS)
    expect(page.locator("#sd-accel-width input[type=number]")).to_have_value("1024")
    expect(page.locator("#sd-accel-cfg input[type=number]")).to_have_value("0")
    _small_torch_run(page)  # 64 px, 2 steps, engines off: quick
    report = page.locator("#sd-accel-report").first
    page.locator("#sd-accel-generate").click()
    expect(report).to_contain_text("2 steps, 2 UNet calls", timeout=BUILD_TIMEOUT_MS)  # (the transformer's)
    expect(page.locator("#sd-accel-gallery img").first).to_be_visible()
    _shot(page, "ui-generate-flux.png")
    model.fill("builtin:tiny-sd15")
    expect(page.locator("#sd-accel-steps input[type=number]")).to_have_value("20", timeout=STEP_TIMEOUT_MS)
