"""The Textual TUI's jobs, driven headless through its pilot on the real default model.

Each test goes through the keys and dialogs a user would use (import, the
quantize form, pull, bench, the chat input) and asserts on the store, the
widgets, the text on screen and the notifications: progress to 100%,
cancelling, a failure's reason kept on screen, streamed replies.
The screens themselves (keys, labels, fit marks, snapshots) are in
tests/test_tui_screens.py.
"""

from __future__ import annotations

import asyncio

import pytest
from support.eval_reports import eval_report, level_eval
from support.helpers import DEFAULT_NAME
from support.tui_pilot import (  # noqa: F401  (pinned_ram: an autouse fixture)
    SIZE,
    errors,
    errors_in,
    make,
    pinned_ram,
    screen_text,
    settled,
    squeeze,
    type_text,
    wait_for,
)

from edgellm.models.store import Store


def test_import_through_the_dialog(default_gguf, edgellm_home):
    from textual.widgets import DataTable

    async def run():
        app = make()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("i")
            await pilot.pause()
            assert type(app.screen).__name__ == "AskModal"
            app.screen.query_one("#ask-path").value = str(default_gguf)
            await pilot.press("enter")  # to the name field
            await type_text(pilot, "imported-135m")
            await pilot.press("enter")
            models = app.screen
            await wait_for(
                pilot,
                lambda: Store().find("imported-135m") is not None and not models.query_one("JobBar").running,
                60,
                "the import",
            )
            await settled(pilot)
            rows = [str(k.value) for k in models.query_one("#store", DataTable).rows]
            bar = models.query_one("JobBar").bar
            return rows, bar.percentage, list(app.notices)

    rows, pct, notices = asyncio.run(run())
    rec = Store().get("imported-135m")
    assert rec.size_bytes == default_gguf.stat().st_size
    assert rec.level == "q4_1" and rec.path.is_file()
    assert "imported-135m" in rows
    assert pct == 1.0
    assert ("information", "imported imported-135m") in notices


def test_broken_file_shows_an_error_notification(tmp_path, edgellm_home):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is a text file, not a model\n" * 20)

    async def run():
        app = make()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("i")
            await pilot.pause()
            app.screen.query_one("#ask-path").value = str(bad)
            await pilot.click("#ok")
            models = app.screen
            await wait_for(pilot, lambda: errors(app), 30, "an error notification")
            await wait_for(pilot, lambda: not models.query_one("JobBar").running, 10, "the job to end")
            return errors(app), app.notices, models.query_one("JobBar").reason

    errs, notices, reason = asyncio.run(run())
    assert len(errs) == 1, notices
    assert "GGUF" in errs[0] or "gguf" in errs[0], errs
    assert errs[0].endswith(reason) and reason, (errs, reason)  # and kept under the job bar
    assert "Traceback" not in errs[0] and "internal error" not in errs[0]
    assert Store().list() == []


def test_quantize_to_q8_0_reaches_100_percent_and_a_queued_job_cancels(default_model, monkeypatch):
    from textual.widgets import DataTable

    from tui.widgets.checklist import CheckBox, CheckList
    from tui.widgets.jobbar import JobBar

    # The bar is shared by the queue: read it as each job finishes, not at the end.
    finished: list[tuple[str, float]] = []
    original_finish = JobBar.finish

    def recording_finish(self, text, *, complete=True, reason=""):
        original_finish(self, text, complete=complete, reason=reason)
        finished.append((text, self.bar.percentage))

    monkeypatch.setattr(JobBar, "finish", recording_finish)
    # Hold the first job at its start until the second is cancelled: a 135M
    # quantize takes well under a second, faster than the pilot's key presses.
    import threading

    from tui.screens import budget_form

    gate, real_run = threading.Event(), budget_form.run_level

    def gated(*a, **kw):
        gate.wait(60)
        return real_run(*a, **kw)

    monkeypatch.setattr(budget_form, "run_level", gated)

    async def run():
        app = make(initial="quantize")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            assert type(scr).__name__ == "QuantizeScreen"
            assert scr.query_one("#quant-base").value == DEFAULT_NAME
            levels = scr.query_one("#quant-levels", CheckList)
            scr.query_one("#quant-requant", CheckBox).value = True  # the default is Q4_1: requantizing
            levels.deselect_all()
            levels.select("q8_0")
            await pilot.press("a")
            levels.deselect_all()
            levels.select("q4_0")
            await pilot.press("a")
            # cancel the second job while the first runs
            table = scr.query_one("#quant-jobs", DataTable)
            table.focus()
            table.move_cursor(row=1)
            await pilot.pause()
            await pilot.press("x")
            jobs = sorted(scr.jobs.values(), key=lambda j: j.id)
            assert [j.level for j in jobs] == ["q8_0", "q4_0"]
            assert jobs[1].token.cancelled and jobs[0].status == "running"
            gate.set()
            await wait_for(pilot, lambda: jobs[0].status in ("done", "failed", "cancelled"), 180, "the first job")
            await wait_for(pilot, lambda: jobs[1].status in ("done", "failed", "cancelled"), 30, "the second job")
            await pilot.pause(0.2)
            results = scr.query_one("#quant-results", DataTable)
            cells = [results.get_row_at(i) for i in range(results.row_count)]
            status_cells = [table.get_row_at(i)[3:] for i in range(table.row_count)]
            return jobs, cells, status_cells, app.notices

    jobs, cells, status_cells, notices = asyncio.run(run())
    assert not [m for s, m in notices if s == "error"], notices
    assert jobs[0].status == "done" and jobs[0].pct == 100.0
    assert (f"#{jobs[0].id} done", 1.0) in finished, finished
    assert status_cells[0] == ["done", "100%", ""]
    assert jobs[1].status == "cancelled" and status_cells[1] == ["cancelled", "0%", "cancelled by the user"]
    assert len(cells) == 1 and cells[0][1] == "Q8_0"
    out = Store().get("smollm2-135m-instruct-q8_0")
    assert out.level == "q8_0" and out.parent == DEFAULT_NAME and out.path.is_file()
    from edgellm.gguf.reader import read_gguf

    assert read_gguf(out.path).level == "q8_0"
    assert Store().find("smollm2-135m-instruct-q4_0") is None


def test_a_failed_quantize_job_keeps_its_reason_on_screen(default_model, default_gguf, monkeypatch):
    """The outputs already exist: the job fails, and 10 s later (past the toast's timeout) its reason is still shown."""
    import textual.notifications
    from textual.widgets import DataTable

    from edgellm.errors import ModelExists
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.resolve import record_from_info
    from quant.quantize import quantize
    from tui.widgets.checklist import CheckBox, CheckList

    taken = "smollm2-135m-instruct-q8_0"
    Store().register(record_from_info(taken, read_gguf(default_gguf), [str(default_gguf)], default_model.sha256, source="test"))
    with pytest.raises(ModelExists) as exc:  # what the core says, for the screen to show
        quantize(DEFAULT_NAME, ["q8_0"], allow_requantize=True)
    reason = str(exc.value)

    async def run():
        app = make(initial="quantize")
        async with app.run_test(size=SIZE, notifications=True) as pilot:  # real toasts, off by default in tests
            scr = app.screen
            scr.query_one("#quant-requant", CheckBox).value = True
            levels = scr.query_one("#quant-levels", CheckList)
            levels.deselect_all()
            levels.select("q8_0")
            await pilot.press("a")
            job = next(iter(scr.jobs.values()))
            await wait_for(pilot, lambda: job.status == "failed", 60, "the job to fail")
            await pilot.pause(0.2)
            toast_then = [str(t.render()) for t in app.screen.query("Toast")]
            # 10 s later on the app's clocks (the toasts' expiry reads textual.notifications.time)
            real = textual.notifications.time
            monkeypatch.setattr(textual.notifications, "time", lambda: real() + 10.0)
            app._refresh_notifications()  # what Textual does when a toast's timer fires
            await pilot.pause(0.2)
            table = scr.query_one("#quant-jobs", DataTable)
            return (
                toast_then,
                list(app.screen.query("Toast")),
                table.get_row_at(0)[3:],
                screen_text(app, scr.query_one("JobBar")),
                list(app.notices),
            )

    toast_then, toasts_later, row, bar_text, notices = asyncio.run(run())
    assert ("error", f"quantize {DEFAULT_NAME} → Q8_0: {reason}") in notices
    assert len(toast_then) == 1 and "already exists" in toast_then[0], toast_then
    assert toasts_later == []  # the toast is gone...
    assert row == ["failed", "0%", reason]  # ...the reason stays in the job's row...
    assert squeeze(reason) in squeeze(bar_text), bar_text  # ...and whole, on screen, under the job bar
    assert "#1 failed" in bar_text


def test_a_failed_pull_keeps_its_reason_until_the_next_job(monkeypatch, default_gguf):
    monkeypatch.setenv("EDGELLM_OFFLINE", "1")  # no network: the pull fails, with a reason

    async def run():
        app = make()
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            scr.start_pull("smollm2-360m-instruct")
            bar = scr.query_one("JobBar")
            await wait_for(pilot, lambda: not bar.running, 30, "the pull to fail")
            await settled(pilot)
            failed = (bar.reason, screen_text(app, bar))
            scr.start_import(str(default_gguf))  # the next job clears it
            await pilot.pause()
            cleared = bar.reason
            await wait_for(pilot, lambda: not bar.running, 60, "the import")
            return failed, cleared, errors(app)

    (reason, shown), cleared, errs = asyncio.run(run())
    assert errs == [f"pull smollm2-360m-instruct: {reason}"] and "offline" in reason.lower(), errs
    assert "pull failed" in shown and squeeze(reason) in squeeze(shown), shown
    assert cleared == ""


def test_bench_memory_panel_follows_the_selected_row(default_model):
    from textual.widgets import DataTable, Input, Sparkline

    from edgellm.fsutil import human_size

    async def run():
        app = make(initial="bench")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            for id_, v in (("#bench-pp", "32"), ("#bench-tg", "8"), ("#bench-reps", "2")):
                scr.query_one(id_, Input).value = v
            await pilot.press("g")
            await wait_for(pilot, lambda: scr.token is None, 300, "the benchmark")
            await pilot.pause(0.2)
            table = scr.query_one("#bench-results", DataTable)
            table.focus()
            seen = []
            for row in (0, 1, 0):
                table.move_cursor(row=row)
                await pilot.pause(0.2)
                seen.append((table.cursor_row, screen_text(app, scr.query_one("#bench-mem"))))
            return scr.rows, seen, list(scr.query_one(Sparkline).data), app.notices

    rows, seen, spark, notices = asyncio.run(run())
    assert not errors_in(notices), notices
    assert [r["test"] for r in rows] == ["pp32", "tg8"]
    for i, text in seen:
        r = rows[i]
        assert f"{r['test']}" in text and human_size(r["rss_bytes"]) in text, (i, text)
        assert human_size(r["anon_bytes"]) in text
    assert seen[0][1] != seen[1][1]
    # the sparkline: every repetition of that run, pp then tg
    assert spark == [*rows[0]["samples_ts"], *rows[1]["samples_ts"]] and len(spark) == 4


def test_chat_streams_a_reply_and_escape_stops_one(default_model):
    from textual.widgets import Input, Markdown

    async def run():
        app = make(initial="chat")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            assert scr.settings()["model"] == DEFAULT_NAME
            scr.query_one("#set-max_tokens", Input).value = "48"
            scr.query_one("#set-seed", Input).value = "7"
            await type_text(pilot, "Hello! Who are you?")
            await pilot.press("enter")
            # started, or (a short reply on a fast core) already streamed by the time the pilot looks
            await wait_for(pilot, lambda: scr.generating or scr.stream_updates > 0, 10, "generation to start")
            lengths = []

            def grow():
                if scr.last_reply:
                    lengths.append(len(scr.last_reply))
                return not scr.generating

            await wait_for(pilot, grow, 120, "the reply")
            await pilot.pause(0.2)
            first = dict(
                reply=scr.last_reply,
                updates=scr.stream_updates,
                lengths=lengths,
                shown="".join(m._markdown for m in scr.query(Markdown)),
                stats=scr.last_stats,
                status=str(scr.query_one("#chat-status").render()),
            )
            # a long reply, stopped with Escape once text is streaming
            scr.query_one("#set-max_tokens", Input).value = "400"
            await type_text(pilot, "Write a long story about a robot.")
            await pilot.press("enter")
            await wait_for(pilot, lambda: scr.generating and scr.last_reply, 60, "the second reply to stream")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not scr.generating, 30, "the reply to stop")
            await pilot.pause(0.2)
            second = dict(stats=scr.last_stats, log=[str(w.render()) for w in scr.query(".msg-info")])
            return first, second, app.notices

    first, second, notices = asyncio.run(run())
    assert not [m for s, m in notices if s == "error"], notices
    assert first["stats"].generated_tokens > 0
    assert first["reply"].strip()
    # streamed: the screen showed the reply growing in several steps (its own count of updates; the pilot's
    # polls may see fewer of them when the reply is short and the core fast)
    assert first["updates"] >= 2, first
    assert first["reply"].strip()[:20] in first["shown"]
    assert "tok/s" in first["status"] and "RSS" in first["status"]
    st = second["stats"]
    assert st.stop_reason == "cancelled" and 0 < st.generated_tokens < 400
    assert "[stopped]" in second["log"]


def test_evaluate_screen_runs_an_evaluation_and_shows_results(tmp_path):
    # A genuinely float tiny llama keeps this fast; the real default model's
    # evaluation is covered in tests/test_eval.py.
    from support.gguf_files import write_tiny_llama
    from textual.widgets import DataTable, Input

    from edgellm.models.resolve import import_file

    import_file(write_tiny_llama(tmp_path / "tiny.gguf"), name="tiny-f16")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")

    async def run():
        app = make(initial="evaluate")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            scr.query_one("#eval-base").value = "tiny-f16"
            scr.query_one("#eval-levels", Input).value = "q8_0,q4_0"
            scr.query_one("#eval-text", Input).value = str(text)
            scr.query_one("#eval-chunks", Input).value = "2"
            await pilot.pause()
            scr.action_run()
            await wait_for(pilot, lambda: scr.token is None, 180, "the evaluation")
            await pilot.pause(0.2)
            table = scr.query_one("#eval-results", DataTable)
            rows = [table.get_row_at(i) for i in range(table.row_count)]
            return rows, str(scr.query_one("#eval-rec").render()), app.notices

    rows, rec, notices = asyncio.run(run())
    assert not [m for s, m in notices if s == "error"], notices
    assert sorted(r[0] for r in rows) == ["Q4_0", "Q8_0"]
    kld = {r[0]: float(r[4]) for r in rows}
    assert 0 < kld["Q8_0"] < kld["Q4_0"]
    assert rec.startswith("Recommendation:")


def test_evaluate_screen_marks_edgellm_files_as_their_own_series():
    from textual.widgets import DataTable

    from tui.widgets.plot import MARKERS, ScatterPlot

    rep = eval_report(
        [
            level_eval("m-q2_k", "q2_k", 88_201_792, 0.41),
            level_eval("m-q2_k-imat", "q2_k", 88_202_080, 0.27),
            level_eval("m-budget-88mb", "q4_k_m", 88_188_256, 0.06),
            level_eval("m-q4_k_m", "q4_k_m", 105_454_144, 0.05),
        ]
    )

    async def run():
        app = make(initial="evaluate")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            scr.show_results(rep)
            await pilot.pause(0.1)
            table = scr.query_one("#eval-results", DataTable)
            return [table.get_row_at(i)[0] for i in range(table.row_count)], scr.query_one(ScatterPlot).render().plain

    tags, plot = asyncio.run(run())
    # A --budget file is not shown as the Q4_K_M its header records.
    assert tags == ["Q2_K", "Q2_K-IMAT", "BUDGET-88MB", "Q4_K_M"]
    legend = plot.rsplit("\n", 1)[-1]
    assert f"{MARKERS[0]} llama.cpp" in legend and f"{MARKERS[1]} edgellm" in legend, legend
    assert plot.count(MARKERS[1]) == 3 and plot.count(MARKERS[0]) == 3, plot  # two points and a legend entry each
