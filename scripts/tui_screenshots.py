"""Write docs/screenshots/<screen>.png: each TUI screen at 100x30, on a
throw-away store holding the default model (one short chat turn, the doctor
run). Textual saves SVG; cairosvg (pip) turns it into PNG.

    .venv/bin/python scripts/tui_screenshots.py [--out docs/screenshots]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def shoot(out: Path) -> None:
    import cairosvg

    from tui.app import make_app

    app = make_app(autorun=False, stable=True)
    async with app.run_test(size=(100, 30)) as pilot:

        async def save(name: str) -> None:
            await pilot.pause(0.3)
            await app.workers.wait_for_complete()  # the screens load their tables in workers
            await pilot.pause(0.2)
            svg = out / f"{name}.svg"
            app.save_screenshot(filename=svg.name, path=str(out))
            cairosvg.svg2png(url=str(svg), write_to=str(out / f"{name}.png"), output_width=1400)
            svg.unlink()
            print("wrote", out / f"{name}.png")

        await save("models")
        await pilot.press("f2")
        await save("quantize")
        await pilot.press("f3")
        await save("evaluate")
        await pilot.press("f5")
        await save("bench")
        await pilot.press("f6")
        scr = app.screen
        scr.action_doctor()
        while scr.running:
            await pilot.pause(0.2)
        await save("system")
        await pilot.press("f4")
        chat = app.screen
        chat.query_one("#set-max_tokens").value = "40"
        chat.query_one("#set-seed").value = "1"
        for ch in "What is GGUF quantization?":
            await pilot.press("space" if ch == " " else ch)
        await pilot.press("enter")
        t0 = time.monotonic()
        while (chat.generating or not chat.last_reply) and time.monotonic() - t0 < 300:
            await pilot.pause(0.2)
        await save("chat")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as home:
        os.environ["EDGELLM_HOME"] = home
        subprocess.run(
            [sys.executable, "-m", "edgellm.cli", "pull", "smollm2-135m-instruct", "--no-progress"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        sys.path.insert(0, str(ROOT))
        asyncio.run(shoot(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
