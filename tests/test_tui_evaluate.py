"""The Evaluate screen's frontier, driven headless (issue #28): recommend()'s
pick marked on the size-vs-loss chart, the base's stored imatrix and
--budget outputs offered by name for the levels field, and `eval`'s
calibration warning on screen. The outputs are real files quantized from
the default model's F16 through the core API, on a small stored matrix.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.eval_reports import eval_report, level_eval
from support.helpers import DEFAULT_NAME
from support.quant_fixtures import F16_NAME
from support.tui_pilot import make, pinned_ram, screen_text, settled, squeeze, wait_for  # noqa: F401  (pinned_ram: autouse)

SIZE = (100, 34)  # room for a wrapped warning under the chart
CALIBRATION = (
    "The river rose through the night and by morning the lower fields were under water. "
    "Farmers moved their animals to the ridge, counted what was left of the grain, and waited. "
    "Nobody in the valley remembered a flood like it, though the old records mention two. "
)


def _stored_report(tmp_path):
    """A saved evaluation of m-f16: three stock levels and a --budget file, Q8_0 the lowest KLD."""
    from quant.evaluate import save_report

    levels = [
        level_eval("m-q4_0", "q4_0", 80_000_000, 0.30),
        level_eval("m-budget-100mb", "q4_k_m", 100_000_000, 0.08),
        level_eval("m-q5_k_m", "q5_k_m", 120_000_000, 0.05),
        level_eval("m-q8_0", "q8_0", 150_000_000, 0.01),
    ]
    levels = [dataclasses.replace(lv, path=str(tmp_path / f"{lv.name}.gguf")) for lv in levels]  # gone: sized from the report
    report = eval_report(levels, parameters=134_515_008, created=1.0, base_path=str(tmp_path / "m-f16.gguf"))
    save_report(report)
    return report


@pytest.mark.parametrize("fit", ["all", "all-but-q8_0"])
def test_the_chart_marks_the_level_recommend_picks(tmp_path, monkeypatch, fit):
    """The ★ point is recommend()'s best: the lowest KLD, or, when RAM is pinned below Q8_0's need, the next one."""
    from edgellm.engine.memory import DEFAULT_CTX as MEMORY_CTX
    from quant.recommend import need_bytes, recommend
    from tui.widgets.plot import RECOMMENDED, ScatterPlot

    report = _stored_report(tmp_path)
    if fit != "all":
        q8 = next(lv for lv in report.levels if lv.level == "q8_0")
        monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(need_bytes(report, q8, MEMORY_CTX) - 1))
    best = recommend().best
    assert best.name == ("m-q8_0" if fit == "all" else "m-q5_k_m")

    async def run():
        app = make(initial="evaluate")
        async with app.run_test(size=SIZE) as pilot:
            await settled(pilot)
            plot = app.screen.query_one(ScatterPlot)
            return plot.recommended, plot.render().plain, screen_text(app, plot), str(app.screen.query_one("#eval-rec").render())

    marked, plot, shown, rec_line = asyncio.run(run())
    assert report.levels[marked].name == best.name
    tag = best.level.upper()
    assert plot.count(RECOMMENDED) == 2, plot  # the point and its legend entry
    point = next(line for line in plot.splitlines() if "│" in line and RECOMMENDED in line)
    assert tag in point, plot  # the point, labelled (left of it at the right edge)
    assert f"{RECOMMENDED} recommended: {tag}" in shown, shown  # the legend, whole, at this size
    assert rec_line.startswith(f"Recommendation: {best.name}")


# -- the base's stored outputs -----------------------------------------------------


def _imatrix_output(text) -> str:
    """The F16 quantized to Q4_0 with a one-chunk matrix computed on `text`: `<base>-q4_0-imat`."""
    from quant.imatrix import compute_imatrix
    from quant.quantize import quantize

    matrix = compute_imatrix(F16_NAME, text=text, chunks=1, ctx=256, threads=2)
    return quantize(F16_NAME, ["q4_0"], imatrix=matrix.name, threads=2)[0].name


def _budget_output() -> str:
    """A --budget-style output: the F16 at Q4_0 under a budget recipe's label and lineage (no search: cheap)."""
    from quant.quantize import TensorOverrides, quantize

    lineage = {"budget": "100MB", "file": "", "predicted_bytes": 0, "excluded_types": [], "type_counts": {}}
    return quantize(F16_NAME, ["q4_0"], overrides=TensorOverrides([], lineage, "budget-100mb"), threads=2)[0].name


def _register_like(name: str, new: str, **changes):
    """Another store record over `name`'s file (a real file, no second quantization)."""
    from edgellm.models.store import ModelRecord, Store

    data = Store().get(name).to_json()
    data.pop("path", None)
    return Store().register(ModelRecord.from_json({**data, "name": new, **changes}))


def test_levels_picker_offers_the_bases_imatrix_and_budget_outputs(f16_model, tmp_path):
    from textual.widgets import Input, Select

    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION * 40, encoding="utf-8")
    imat, budget = _imatrix_output(text), _budget_output()
    assert imat.endswith("-q4_0-imat") and budget.endswith("-budget-100mb")
    _register_like(imat, f"{F16_NAME}-q4_0-plain", extra={})  # a plain child: not offered

    def offered(scr) -> list[str]:
        sel = scr.query_one("#eval-stored", Select)
        return [str(v) for _label, v in sel._options if isinstance(v, str)]

    async def run():
        app = make(initial="evaluate")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            assert scr.query_one("#eval-base", Select).value == F16_NAME  # the float base is the default pick
            first = offered(scr)
            # picking one adds its name to the field, once
            levels = scr.query_one("#eval-levels", Input)
            levels.value = "q8_0"
            for pick in (budget, budget, imat):
                scr.query_one("#eval-stored", Select).value = pick
                await pilot.pause(0.1)
            field = levels.value
            cleared = scr.query_one("#eval-stored", Select).value
            # another base: its own outputs (the Q4_1 parent has none)
            scr.query_one("#eval-base", Select).value = DEFAULT_NAME
            await settled(pilot)
            other_base = offered(scr)
            scr.query_one("#eval-base", Select).value = F16_NAME
            await settled(pilot)
            # a new output appears on refresh
            _register_like(imat, f"{F16_NAME}-q4_0-imat2")
            await pilot.press("r")
            await settled(pilot)
            return first, field, cleared, other_base, offered(scr), screen_text(app)

    first, field, cleared, other_base, refreshed, shown = asyncio.run(run())
    assert sorted(first) == sorted([imat, budget])
    assert field == f"q8_0,{budget},{imat}"
    assert cleared is Select.NULL
    assert other_base == []
    assert sorted(refreshed) == sorted([imat, budget, f"{F16_NAME}-q4_0-imat2"])
    assert "Stored" in shown and "3 stored: pick one to add it to Levels" in shown, shown


def test_calibration_text_as_evaluation_text_warns_on_screen(f16_model, tmp_path):
    """`eval`'s warning when the evaluation text is an output's calibration text, on screen as `warning: ...`."""
    from textual.widgets import Input, Static

    from quant.evaluate import load_eval_results
    from quant.recommend import recommend
    from tui.widgets.plot import ScatterPlot

    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION * 40, encoding="utf-8")
    imat = _imatrix_output(text)

    async def run():
        app = make(initial="evaluate")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            scr.query_one("#eval-levels", Input).value = imat
            scr.query_one("#eval-text", Input).value = str(text)
            scr.query_one("#eval-chunks", Input).value = "2"
            scr.action_run()
            await wait_for(pilot, lambda: scr.token is None, 120, "the evaluation")
            await settled(pilot)
            box = scr.query_one("#eval-warnings", Static)
            return str(box.render()), screen_text(app, box), list(app.notices), scr.query_one(ScatterPlot).recommended

    content, shown, notices, marked = asyncio.run(run())
    assert not [m for s, m in notices if s == "error"], notices
    (report,) = load_eval_results()
    # (the F16 was converted from the Q4_1: the lineage warning comes first)
    (warning,) = [w for w in report.warnings if w.startswith(f"{imat}: ")]
    assert "its importance matrix was computed on this evaluation text" in warning
    assert content == "\n".join(f"warning: {w}" for w in report.warnings)
    assert squeeze(f"warning: {warning}") in squeeze(shown)  # all of it on screen, wrapped
    # a fresh report's point is marked too: the one output, recommend()'s only candidate
    assert marked is not None and report.levels[marked].name == recommend().best.name == imat
