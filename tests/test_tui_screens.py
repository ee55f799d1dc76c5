"""The Textual TUI's screens: the F-keys from anywhere (the chat box
included) and on screen, every input labelled, the fit marks on the core's
one estimate, and an SVG snapshot of every screen at 100x30 with an empty
store and a pinned available-RAM figure, so they hold on any machine.
Refresh the snapshots with `pytest tests/test_tui_screens.py --snapshot-update`
and read the SVGs before committing them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_textual_snapshot
from support.helpers import DEFAULT_NAME
from support.tui_pilot import SCREEN_CYCLE, SIZE, make, pinned_ram, screen_text, settled, type_text  # noqa: F401  (pinned_ram: an autouse fixture)

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"

# Snapshots live in tests/snapshots/ rather than syrupy's __snapshots__/.
pytest_textual_snapshot.SVGImageExtension.dirname = classmethod(lambda cls, *, test_location: str(SNAPSHOT_DIR))


def test_every_screen_opens_by_key(default_model):
    from textual.widgets import DataTable

    async def run():
        app = make()
        async with app.run_test(size=SIZE) as pilot:
            seen = []
            for key in ("f1", "f2", "f3", "f4", "f5", "f6", "f1"):
                await pilot.press(key)
                await pilot.pause()
                seen.append(type(app.screen).__name__)
            await settled(pilot)
            names = [k.value for k in app.screen.query_one("#store", DataTable).rows]
            assert DEFAULT_NAME in names
            # ctrl+q quits from anywhere, even with the chat input focused
            await pilot.press("f4")
            await pilot.press("ctrl+q")
            await pilot.pause()
        return seen

    seen = asyncio.run(run())
    assert seen == SCREEN_CYCLE


def test_f5_from_the_chat_box_switches_to_bench_and_types_nothing(default_model):
    from textual.widgets import Input

    async def run():
        app = make(initial="chat")
        async with app.run_test(size=SIZE) as pilot:
            chat = app.screen
            box = chat.query_one("#chat-input", Input)
            assert app.focused is box
            await type_text(pilot, "hi 5")  # a digit types into the box, as text should
            nav_before = screen_text(app).splitlines()[0]
            await pilot.press("f5")
            await pilot.pause()
            shown = type(app.screen).__name__
            bench_nav = screen_text(app).splitlines()[0]
            await pilot.press("f4")
            await pilot.pause()
            return shown, box.value, app.focused is box, nav_before, bench_nav

    async def nav_at_80_columns():
        app = make(initial="chat")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            return screen_text(app).splitlines()[0]

    shown, value, refocused, nav_before, bench_nav = asyncio.run(run())
    narrow = asyncio.run(nav_at_80_columns())
    assert shown == "BenchScreen"
    assert value == "hi 5"  # F5 switched screens and reached the box neither as text nor as a key
    assert refocused
    # the keys are on screen, on every screen
    for nav in (nav_before, bench_nav, narrow):
        assert all(
            f"F{i} {label}" in nav for i, label in enumerate(["Models", "Quantize", "Evaluate", "Chat", "Bench", "System"], 1)
        ), nav
        assert "^q Quit" in nav


def test_every_input_is_labelled(default_model):
    from textual.widgets import Input, Label

    async def run():
        app = make()
        unlabelled, seen = [], 0
        async with app.run_test(size=SIZE) as pilot:
            for key in ("f1", "f2", "f3", "f4", "f5", "f6"):
                await pilot.press(key)
                await settled(pilot)
                for inp in app.screen.query(Input):
                    seen += 1
                    siblings = list(inp.parent.children)
                    before = siblings[siblings.index(inp) - 1] if siblings.index(inp) else None
                    if not (isinstance(before, Label) and str(before.render()).strip()) and not inp.border_title:
                        unlabelled.append(f"{key}: #{inp.id}")
        return unlabelled, seen

    unlabelled, seen = asyncio.run(run())
    assert seen >= 17  # Evaluate 3, Bench 3, Chat 1 + 11 settings
    assert unlabelled == []


def test_fit_marks_use_the_bytes_models_list_reports(default_model, cli, monkeypatch):
    """The store's fit mark flips from ~ to ✗ at exactly the RAM `models list --json` says the model needs."""
    from textual.widgets import DataTable

    listed = cli("models", "list", "--json", "--local")
    assert listed.exit_code == 0, listed
    need = next(m["ram_needed_bytes"] for m in listed.json()["models"] if m["name"] == DEFAULT_NAME)
    assert need > default_model.size_bytes  # weights and more

    async def mark(ram: int) -> tuple[str, str]:
        monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(ram))
        app = make()
        async with app.run_test(size=SIZE) as pilot:
            await settled(pilot)
            row = app.screen.query_one("#store", DataTable).get_row(DEFAULT_NAME)
            return row[1], screen_text(app)

    (at_need, text), (below, _) = asyncio.run(mark(need)), asyncio.run(mark(need - 1))
    assert (at_need, below) == ("~", "✗")
    assert "Fit: RAM needed at ctx 4096" in text


SCREEN_KEYS = {
    "models": ["f1"],
    "quantize": ["f2"],
    "quantize-budget": ["f2", "m"],
    "imatrix-panel": ["f2", "i"],
    "evaluate": ["f3"],
    "chat": ["f4"],
    "chat-settings": ["f4", "ctrl+t"],
    "bench": ["f5"],
    "system": ["f6"],
}


@pytest.mark.parametrize("keys", list(SCREEN_KEYS.values()), ids=list(SCREEN_KEYS))
def test_snapshot(snap_compare, keys, edgellm_home):
    async def show(pilot):
        await settled(pilot)  # the Models screen's store scan, on every start
        for key in keys:
            await pilot.press(key)
            await settled(pilot)

    assert snap_compare(make(), terminal_size=SIZE, run_before=show)


# A saved evaluation as `edgellm eval` writes it: llama.cpp's levels and edgellm's imatrix/--budget files of
# one base, one of them scored on its own calibration text. Fixed figures, so the snapshot holds anywhere.
_FRONTIER = [  # name suffix, level, size, mean KLD, ΔPPL %, same top %
    ("q4_0", "q4_0", 85_847_360, 0.1456, 9.81, 83.1),
    ("q4_0-imat", "q4_0", 85_847_360, 0.0981, 6.52, 86.4),
    ("budget-100mb", "q4_k_m", 99_981_312, 0.0405, 2.77, 91.0),
    ("q4_k_m", "q4_k_m", 105_454_144, 0.0562, 3.93, 89.7),
    ("q5_k_m", "q5_k_m", 112_032_000, 0.0213, 1.42, 93.6),
    ("q8_0", "q8_0", 144_811_840, 0.0021, 0.10, 98.2),
]


def _save_frontier_report() -> None:
    import dataclasses
    import types

    from support.eval_reports import eval_report, level_eval

    from edgellm.models.store import ModelRecord
    from quant.evaluate import save_report
    from quant.imatrix import calibration_warnings

    base, base_ppl, sha = "smollm2-135m-instruct-f16", 17.52, "3f1c0a9e5b2d" + "0" * 52
    levels = [
        dataclasses.replace(
            level_eval(f"smollm2-135m-instruct-{tag}", level, size, kld),
            path=f"/nonexistent/{tag}.gguf",  # gone from the store: sized from the report, as recommend() does
            ppl=base_ppl * (1 + dppl / 100),
            dppl_pct=dppl,
            same_top_p=top,
            tokens_per_second=900.0,
        )
        for tag, level, size, kld, dppl, top in _FRONTIER
    ]
    # The warning in the core's own words: the imatrix file's lineage names this very text.
    lineage = {"imatrix": {"text": "calibration.txt", "text_sha256": sha}}
    store = types.SimpleNamespace(
        find=lambda n: ModelRecord(name=n, files=[], size_bytes=0, sha256="", extra=lineage) if n.endswith("-imat") else None
    )
    save_report(
        eval_report(
            levels,
            base=base,
            base_path="/nonexistent/base.gguf",
            base_level="f16",
            base_size_bytes=270_898_432,
            base_ppl=base_ppl,
            parameters=134_515_008,
            corpus="calibration.txt",
            corpus_sha256=sha,
            ctx=512,
            chunks=4,
            created=1_700_000_000.0,
            warnings=calibration_warnings([lv.name for lv in levels], sha, store),
        )
    )


def test_snapshot_evaluate_frontier(snap_compare, edgellm_home):
    """Evaluate on a saved report: the two series, recommend()'s pick (★) and the calibration warning."""
    _save_frontier_report()
    assert snap_compare(make(initial="evaluate"), terminal_size=SIZE, run_before=settled)
