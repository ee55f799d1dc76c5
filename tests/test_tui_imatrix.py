"""The importance-matrix panel (Quantize, `i`), driven through its keys on the
real default model's F16 and the real llama.cpp (#28): a matrix computed in
the panel is listed with the fields `edgellm imatrix --list --json` gives,
its lineage shown, deleted after a confirmation; a compute cancelled with
Escape leaves no file and no record, and the next one completes."""

from __future__ import annotations

import asyncio
import time

from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401  (fixtures)
from support.tui_pilot import SIZE, errors, make, pinned_ram, screen_text, settled, squeeze, type_text, wait_for  # noqa: F401

MATRIX = f"{F16_NAME}-imatrix"
JOB_TIMEOUT = 300  # 2 chunks take seconds; a busy 2-core machine, much longer


async def open_panel(pilot, app):
    """Quantize with the F16 as its base, then `i`: the panel."""
    await settled(pilot)
    app.screen.query_one("#quant-base").value = F16_NAME
    app.screen.query_one("#quant-jobs").focus()  # as a user who tabbed off the form
    await settled(pilot)
    await pilot.press("i")
    await settled(pilot)
    assert type(app.screen).__name__ == "ImatrixPanel"
    return app.screen


async def compute(pilot, panel, chunks: str) -> None:
    """Type the chunks and press Enter in the field: the compute starts."""
    box = panel.query_one("#imx-chunks")
    box.value = ""
    box.focus()
    await type_text(pilot, chunks)
    await pilot.press("enter")
    await pilot.pause()
    # started: still running, or already done (a warm machine can finish 2 chunks within the pause)
    assert panel.token is not None or any("done" in m for _, m in app_notices(panel)), app_notices(panel)


async def finished(pilot, panel) -> None:
    await wait_for(pilot, lambda: panel.token is None, timeout=JOB_TIMEOUT, what="the compute to end")
    await settled(pilot)


def app_notices(panel) -> list:
    return panel.app.notices


def job_line(panel) -> str:
    return str(panel.query_one("#imx-job .job-detail").render())


def files(home) -> list[str]:
    folder = home / "imatrix"
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


def test_compute_lists_inspects_and_deletes_a_matrix(f16_model, cli, edgellm_home):
    from textual.widgets import DataTable, Input, Label, Select

    from tui.screens.imatrix_panel import ImatrixPanel

    async def computed():
        app = make(initial="quantize")
        async with app.run_test(size=SIZE) as pilot:
            panel = await open_panel(pilot, app)
            # the model defaults to the Quantize screen's base; every field has its label before it
            assert panel.query_one("#imx-model", Select).value == F16_NAME
            for field in [*panel.query(Input), *panel.query(Select)]:
                siblings = list(field.parent.children)
                before = siblings[siblings.index(field) - 1]
                assert isinstance(before, Label) and str(before.render()).strip(), field.id
            footer = screen_text(app).splitlines()[-1]
            assert all(b.description in footer for b in ImatrixPanel.BINDINGS), footer
            t0 = time.monotonic()
            await compute(pilot, panel, "2")
            await finished(pilot, panel)
            seconds = time.monotonic() - t0
            assert errors(app) == [], app.notices
            table = panel.query_one("#imx-list", DataTable)
            row = [str(c) for c in table.get_row(MATRIX)]
            done_line = job_line(panel)
            on_done = str(panel.query_one("#imx-detail").render())
            # v on the selected row shows the same lineage
            panel.query_one("#imx-detail").update("")
            table.focus()
            await pilot.press("v")
            await pilot.pause()
            on_v = str(panel.query_one("#imx-detail").render())
            return row, done_line, on_done, on_v, seconds

    row, done_line, on_done, on_v, seconds = asyncio.run(computed())
    print(f"compute, 2 chunks, through the panel: {seconds:.1f} s")
    listed = cli("imatrix", "--list", "--json").json()
    assert [r["name"] for r in listed] == [MATRIX]
    rec = listed[0]
    day = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec["created"]))
    assert row == [
        rec["name"],
        rec["model"],
        rec["text"],
        str(rec["tokens"]),
        f"{rec['chunks']} x {rec['ctx']}",
        day,
        str(rec["entries"]),
    ]
    assert rec["chunks"] == 2 and rec["model"] == F16_NAME and rec["model_sha256"] == f16_model.sha256
    assert done_line == f"imatrix {F16_NAME} done"
    # the lineage: the CLI's description, then the model's and the text's sha256
    shown = cli("imatrix", "--list").stdout.strip()
    assert on_done == on_v
    for needle in (shown, rec["file"], rec["model_sha256"], rec["text_sha256"]):
        assert squeeze(needle) in squeeze(on_v), (needle, on_v)
    assert files(edgellm_home) == [f"{MATRIX}.gguf", f"{MATRIX}.json"]

    async def deleted():
        app = make(initial="quantize")
        async with app.run_test(size=SIZE) as pilot:
            panel = await open_panel(pilot, app)  # a new session lists what the last one made
            table = panel.query_one("#imx-list", DataTable)
            assert [k.value for k in table.rows] == [MATRIX]
            table.focus()
            await pilot.press("d")
            await pilot.pause()
            asked = type(app.screen).__name__
            await pilot.press("y")
            await settled(pilot)
            return asked, [k.value for k in table.rows], list(app.notices)

    asked, rows, notices = asyncio.run(deleted())
    assert asked == "ConfirmModal"
    assert ("information", f"deleted {MATRIX}") in notices
    assert rows == [""]  # the placeholder row
    assert files(edgellm_home) == []
    assert cli("imatrix", "--list", "--json").json() == []


def test_cancelled_compute_leaves_nothing_and_a_rerun_completes(f16_model, cli, edgellm_home):
    from textual.widgets import DataTable

    async def run():
        app = make(initial="quantize")
        async with app.run_test(size=SIZE) as pilot:
            panel = await open_panel(pilot, app)
            # 8 chunks: two decodes of 4, seconds each, so Escape lands mid-job
            await compute(pilot, panel, "8")
            await wait_for(pilot, lambda: "chunk" in job_line(panel), timeout=JOB_TIMEOUT, what="the first chunk")
            await pilot.press("escape")  # from the chunks field, where the focus still is
            await finished(pilot, panel)
            out = {"cancelled": job_line(panel), "open": app.screen is panel, "left": files(edgellm_home)}
            out["errors"] = errors(app)
            await compute(pilot, panel, "2")
            await finished(pilot, panel)
            out["rerun"] = job_line(panel)
            out["rows"] = [k.value for k in panel.query_one("#imx-list", DataTable).rows]
            # with no job running, Escape closes the panel: back on Quantize
            await pilot.press("escape")
            await pilot.pause()
            out["after"] = type(app.screen).__name__
            return out

    out = asyncio.run(run())
    assert out["cancelled"] == f"imatrix {F16_NAME} cancelled", out
    assert out["open"] and out["left"] == [] and out["errors"] == [], out
    assert out["rerun"] == f"imatrix {F16_NAME} done", out
    assert out["rows"] == [MATRIX]
    assert out["after"] == "QuantizeScreen"
    assert [r["name"] for r in cli("imatrix", "--list", "--json").json()] == [MATRIX]
    assert files(edgellm_home) == [f"{MATRIX}.gguf", f"{MATRIX}.json"]
