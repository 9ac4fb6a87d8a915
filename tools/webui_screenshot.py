"""Takes the README's picture of the chat page (docs/img/webui.png) from a live `topk serve` in headless Chromium.

    python tools/webui_screenshot.py [--cache DIR] [--out docs/img/webui.png] [--chromium PATH]

Without --cache, examples/docs is prefilled with the shipped demo model into a temporary folder named demo-cache.
The page asks the demo's amber-fox and silver-owl questions, then opens the first source of the second answer:
the picture shows the streamed answers, their sources and the passage one of them drew on. Needs Playwright and
a Chromium (Debian's `chromium`, found on PATH, or `python -m playwright install chromium`); Pillow, when there,
stores it with a 128-colour palette.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the special magic number for amber-fox?", "What is the special magic number for silver-owl?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, help="a cache to serve (default: the demo cache, prefilled now)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "webui.png", help="where the PNG goes")
    ap.add_argument("--chromium", help="the browser binary (default: chromium on PATH, else Playwright's own)")
    args = ap.parse_args()
    from playwright.sync_api import expect, sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache
        if cache is None:
            from topk_decode.demo import default_model_dir
            from topk_decode.prefill.build import build_cache

            cache = Path(tmp) / "demo-cache"
            build_cache(ROOT / "examples" / "docs", cache, default_model_dir()[0], device="cpu")
        proc = subprocess.Popen(
            [sys.executable, "-m", "topk_decode", "serve", str(cache), "--port", "0", "--device", "cpu"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            if not line.startswith("serving "):
                sys.exit(f"topk serve did not start: {line!r}")
            base = line.split(" on ")[1].split("/v1")[0]
            for _ in range(300):
                try:
                    urllib.request.urlopen(base + "/health", timeout=5).read()
                    break
                except OSError:
                    time.sleep(0.2)
            path = args.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=path) if path else p.chromium.launch()
                page = browser.new_page(viewport={"width": 1200, "height": 640}, color_scheme="light")
                page.goto(base + "/")
                for i, question in enumerate(QUESTIONS):
                    page.get_by_label("Question").fill(question)
                    page.get_by_label("Question").press("Enter")
                    answer = page.locator("article.msg.assistant").nth(i)
                    expect(answer).to_have_attribute("aria-busy", "false", timeout=120_000)
                answer.locator(".sources button").first.click()
                expect(page.locator("#passage-text mark")).to_be_visible()
                page.locator("#passage-close").focus()
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out))
                browser.close()
            try:  # a 128-colour palette: a third of the bytes, the same picture to the eye
                from PIL import Image

                Image.open(args.out).convert("RGB").quantize(colors=128).save(args.out, optimize=True)
            except ImportError:
                pass
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
