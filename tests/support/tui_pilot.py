"""Driving the Textual app headless in tests: the app as tests build it,
waiting on its workers, and reading what the terminal shows.

Test modules import these (`from support.tui_pilot import ...`), the
`pinned_ram` fixture included: it is autouse wherever it is imported.
"""

from __future__ import annotations

import time

import pytest

SIZE = (100, 30)

# F1 to F6 in order, then F1 again: the screens a walk through every key shows.
SCREEN_CYCLE = ["ModelsScreen", "QuantizeScreen", "EvaluateScreen", "ChatScreen", "BenchScreen", "SystemScreen", "ModelsScreen"]


@pytest.fixture(autouse=True)
def pinned_ram(monkeypatch):
    # The fit marks compare with the core's available-RAM figure: pinned, not the machine's.
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(4 << 30))


def make(**kw):
    from tui.app import make_app

    kw.setdefault("autorun", False)
    kw.setdefault("stable", True)
    return make_app(**kw)


async def wait_for(pilot, cond, timeout: float = 120.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.1)


async def type_text(pilot, text: str) -> None:
    for ch in text:
        await pilot.press("space" if ch == " " else ch)


def errors(app) -> list[str]:
    return errors_in(app.notices)


def errors_in(notices) -> list[str]:
    return [m for sev, m in notices if sev == "error"]


def screen_text(app, widget=None) -> str:
    """What the terminal shows (of `widget`'s region, when given), as plain text lines."""
    strips = app.screen._compositor.render_strips()
    if widget is None:
        return "\n".join(s.text.rstrip() for s in strips)
    r = widget.region
    return "\n".join(s.crop(r.x, r.right).text.rstrip() for s in strips[r.y : r.bottom])


def squeeze(text: str) -> str:
    """Text with all whitespace gone: a line wrapped on screen still matches."""
    return "".join(text.split())


async def settled(pilot) -> None:
    """Until the workers the screen started (store scans, saved results) have shown their results."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause(0.1)
