"""The Quantize screen's size-budget mode, driven through its keys on the real
default model and the real llama.cpp (issue #28): the CLI's error line under
the field for a bad budget, a budget search byte-identical to the CLI's, and
a cancelled search that leaves nothing behind."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from support.quant_fixtures import F16_NAME, f16_model, f16_session  # noqa: F401  (fixtures)
from support.tui_pilot import SIZE, errors, make, pinned_ram, settled, type_text, wait_for  # noqa: F401

from edgellm.models.store import Store


async def _budget_mode(pilot, app, budget: str, exclude: str = "") -> None:
    """Base: the F16; `m` to the budget mode; type the budget and the excluded types."""
    scr = app.screen
    scr.query_one("#quant-base").value = F16_NAME
    await settled(pilot)
    await pilot.press("m")
    await settled(pilot)
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
