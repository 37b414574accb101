#!/usr/bin/env python3
"""Screenshot a workflow that uses sd-accel's nodes, in a real ComfyUI's own frontend (headless browser).

With ComfyUI running (the pack installed) and Playwright + a chromium present:

    python scripts/comfyui_screenshot.py --url http://127.0.0.1:8188 --ckpt sd15-random.safetensors \
        --lora random-lora.safetensors --controlnet cn-random-sd15.safetensors --hint hint.png \
        --out docs/assets/comfyui-workflow.png

The graph is the engine run of ``scripts/comfyui_workflows.py`` (sd-accel Apply Engines, CLIP Text
Encode and VAE Decode, with ComfyUI's LoRA loader and ControlNet apply node), loaded through the
frontend's ``app.loadApiJson`` and queued, so the screenshot shows the finished image too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_workflows import graph  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8188")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--lora")
    ap.add_argument("--controlnet")
    ap.add_argument("--hint")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cfg", type=float, default=7.0)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", default="workflow.png")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    args.torch_clip = False
    g = graph(args, engines=True, lora=1.0 if args.lora else None, controlnet=bool(args.controlnet),
              prefix="sdaccel_screenshot")

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 2600, "height": 1000})
        page.goto(args.url)
        page.wait_for_function("() => window.app && window.app.graph", timeout=120_000)
        page.evaluate("(g) => window.app.loadApiJson(g, 'sd-accel workflow')", g)
        page.wait_for_timeout(1500)
        page.evaluate("() => window.app.queuePrompt(0, 1)")
        page.wait_for_timeout(3000)
        start = time.time()
        while time.time() - start < args.timeout:  # done when ComfyUI's queue is empty again
            with urllib.request.urlopen(f"{args.url}/queue", timeout=30) as r:
                queue = json.loads(r.read())
            if not queue["queue_running"] and not queue["queue_pending"]:
                break
            page.wait_for_timeout(2000)
        else:
            raise SystemExit("the workflow did not finish in time")
        page.mouse.click(900, 760)  # an empty spot of the canvas, then the frontend's "fit view" key
        page.keyboard.press(".")
        page.wait_for_timeout(1500)
        page.screenshot(path=args.out)
        browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
