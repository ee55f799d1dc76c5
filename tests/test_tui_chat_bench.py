"""The TUI's Bench and Chat screens do what `edgellm bench` and `edgellm chat --draft` do (#28),
driven through their keys on the real default model:

* Bench: each row shows the roofline fraction and the read bandwidth of the core's row, for a
  fresh run and for the saved results the screen opens with; a row saved before those figures
  existed shows "-";
* Chat: speculation n-gram at temperature 0 gives the reply speculation off gives, and the
  status line shows the core's accepted/drafted counters;
* a draft length that does not parse is refused with one line, as the CLI refuses it, and
  nothing is sent.
"""

from __future__ import annotations

import asyncio
import json

from edgellm.fsutil import human_size
from edgellm.paths import results_dir
from edgellm.profile.results import load_bench_results
from support.helpers import DEFAULT_NAME
from support.tui_pilot import SIZE, errors_in, make, pinned_ram, screen_text, settled, squeeze, type_text, wait_for  # noqa: F401  (pinned_ram: an autouse fixture)

PASSAGE = (
    "The lighthouse stood on the northern cape for two hundred years. Its keeper, Ada Moss, "
    "wrote in her log every night: the light is lit, the sea is calm, and the ships are safe."
)
PROMPT = f"Repeat this paragraph exactly, word for word: {PASSAGE}"


async def fill_in(pilot, widget, text: str) -> None:
    """Replace a field's text the way a user does: focus it, clear it, type."""
    widget.focus()
    await pilot.press("home", "ctrl+k")
    await type_text(pilot, text)


async def pick(pilot, select, value: str) -> None:
    """Choose `value` in a Select with its keys: open the list, arrow to it, Enter."""
    from textual.widgets._select import SelectOverlay

    select.focus()
    await pilot.press("enter")
    await pilot.pause()
    overlay = select.query_one(SelectOverlay)
    target = [v for _, v in select._options].index(value)
    while overlay.highlighted != target:
        await pilot.press("down" if (overlay.highlighted or 0) < target else "up")
    await pilot.press("enter")
    await pilot.pause()
    assert select.value == value


# -- Bench ----------------------------------------------------------------------


def _figures(row: dict) -> list[str]:
    """What the Roofline and Read BW cells say for a core row: its own numbers, or "-"."""
    frac, bw = row.get("roofline_fraction"), row.get("bandwidth_bytes_per_s")
    return ["-" if frac is None else f"{100 * frac:.0f}%", f"{human_size(bw)}/s" if bw else "-"]


def test_bench_rows_show_the_cores_roofline_fraction_and_read_bandwidth(default_model):
    from textual.widgets import DataTable

    async def shown(app, pilot) -> tuple[list[dict], list[list[str]], list[str], str]:
        scr = app.screen
        table = scr.query_one("#bench-results", DataTable)
        head = [str(c.label) for c in table.columns.values()]
        return list(scr.rows), [list(map(str, table.get_row_at(i))) for i in range(table.row_count)], head, screen_text(app)

    async def run_bench():
        app = make(initial="bench")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            for id_, v in (("#bench-pp", "32"), ("#bench-tg", "8"), ("#bench-reps", "2")):
                await fill_in(pilot, scr.query_one(id_), v)
            scr.query_one("#bench-results").focus()
            await pilot.press("g")
            await wait_for(pilot, lambda: scr.token is None, 300, "the benchmark")
            await pilot.pause(0.2)
            return await shown(app, pilot), app.notices

    async def reopen():
        app = make(initial="bench")
        async with app.run_test(size=SIZE) as pilot:
            await settled(pilot)
            return await shown(app, pilot)

    (rows, cells, head, text), notices = asyncio.run(run_bench())
    assert not errors_in(notices), notices
    assert [r["test"] for r in rows] == ["pp32", "tg8"]
    col = head.index("Roofline")
    assert head[col : col + 2] == ["Roofline", "Read BW"]
    # the core measured the bandwidth for both tests and put generation against its roofline
    assert all(r["bandwidth_bytes_per_s"] > 0 for r in rows)
    pp, tg = rows
    assert pp["roofline_fraction"] is None and 0 < tg["roofline_fraction"]
    assert tg["roofline_fraction"] == tg["avg_ts"] / tg["roofline_ts"]
    for r, c in zip(rows, cells, strict=True):
        assert c[col : col + 2] == _figures(r), (r["test"], c)
    # on screen, at the tests' terminal size, beside the other columns
    lines = [ln for ln in text.splitlines() if "tg8" in ln]
    assert lines and all(f in lines[0] for f in _figures(tg)), text

    # the saved results the screen opens with: the same rows, the same figures
    saved = load_bench_results(DEFAULT_NAME)
    (rows2, cells2, _, _) = asyncio.run(reopen())
    assert [r["test"] for r in rows2] == ["pp32", "tg8"]
    assert [c[col : col + 2] for c in cells2] == [_figures(r) for r in saved] == [_figures(r) for r in rows]

    # a result saved before these figures existed: "-", the rest of the row as before
    (f,) = (results_dir() / "bench").glob("*.json")
    doc = json.loads(f.read_text())
    for r in doc["rows"]:
        for k in ("bandwidth_bytes_per_s", "read_bytes_per_token", "roofline_ts", "roofline_fraction"):
            r.pop(k)
    f.write_text(json.dumps(doc))
    (rows3, cells3, _, _) = asyncio.run(reopen())
    assert [c[col : col + 2] for c in cells3] == [["-", "-"], ["-", "-"]]
    assert [c[:3] for c in cells3] == [c[:3] for c in cells2]


# -- Chat -----------------------------------------------------------------------


async def _settings(pilot, scr, **values: str) -> None:
    """Type into the Settings tab's fields (Ctrl+T), then back to the conversation (Ctrl+L)."""
    from textual.widgets import Input

    await pilot.press("ctrl+t")
    for key, v in values.items():
        await fill_in(pilot, scr.query_one(f"#set-{key}", Input), v)
    await pilot.press("ctrl+l")


async def _ask(pilot, scr, text: str) -> dict:
    before = scr.last_stats
    await type_text(pilot, text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: scr.last_stats is not before and not scr.generating, 300, f"the reply ({pilot.app.notices})")
    await pilot.pause(0.2)
    status = scr.query_one("#chat-status")
    return dict(reply=scr.last_reply, stats=scr.last_stats, status=str(status.render()), shown=screen_text(pilot.app, status))


def test_chat_ngram_speculation_gives_the_same_reply_and_shows_its_counters(default_model):
    from textual.widgets import Select

    async def run():
        app = make(initial="chat")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            assert scr.settings()["model"] == DEFAULT_NAME
            await _settings(pilot, scr, temperature="0", max_tokens="64", threads="1")
            plain = [await _ask(pilot, scr, PROMPT) for _ in range(2)]
            await pilot.press("ctrl+n")
            await pilot.press("ctrl+t")
            # the draft model picker is for the "draft model" mode alone
            picker = scr.query_one("#set-draft-model", Select)
            was_disabled = picker.disabled
            await pick(pilot, scr.query_one("#set-draft", Select), "ngram")
            await pilot.press("ctrl+l")
            # the second turn drafts from the first reply too, with what the first learned of its drafts
            spec = [await _ask(pilot, scr, PROMPT) for _ in range(2)]
            return plain, spec, was_disabled, picker.disabled, scr.drafting.mode, app.notices

    plain, spec, was_disabled, disabled, mode, notices = asyncio.run(run())
    assert not errors_in(notices), notices
    assert was_disabled and disabled and mode == "ngram"
    for p, s in zip(plain, spec, strict=True):
        st0, st1 = p["stats"], s["stats"]
        assert st0.draft == "off" and st0.draft_tokens == 0 and "drafts" not in p["status"]
        # lossless: the reply is token for token the one decoding without drafts gives
        assert s["reply"] == p["reply"] and st1.generated_tokens == st0.generated_tokens
        assert PASSAGE[:40] in p["reply"]  # the model did repeat the paragraph: its n-grams can draft
        assert st1.draft == "ngram" and 0 <= st1.draft_accepted <= st1.draft_tokens
        assert f"drafts {st1.draft_accepted}/{st1.draft_tokens} accepted" in s["status"], s["status"]
        assert f"{st1.tokens_per_second:.1f} tok/s" in s["status"]
        assert squeeze(s["status"]) == squeeze(s["shown"])  # all of it on screen
    # the second turn drafted from the first reply, and its drafts were accepted
    assert spec[1]["stats"].draft_accepted > 0


def test_a_bad_draft_length_is_refused_in_one_line_and_nothing_is_sent(default_model, cli):
    from textual.widgets import Input

    # the CLI refuses a draft length that is not a whole number before loading anything, its error line naming the value
    bad = cli("chat", DEFAULT_NAME, "-p", "hi", "--draft", "ngram", "--draft-max", "four", "--no-history")
    cli_errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("Error:")]
    assert bad.exit_code == 2 and len(cli_errors) == 1 and "'four'" in cli_errors[0], bad.stderr
    # a negative one is the core's check (edgellm.chat.draft.check_draft_max): the TUI shows the CLI's line
    neg = cli("chat", DEFAULT_NAME, "-p", "hi", "--draft", "ngram", "--draft-max", "-3", "--no-history")
    assert neg.exit_code != 0 and neg.stderr.startswith("error: --draft-max") and neg.stderr.count("\n") == 1, neg.stderr
    neg_line = neg.stderr.strip().removeprefix("error: ")
    # past the limit a verify step takes another attention path in llama.cpp and the reply would change: refused
    big = cli("chat", DEFAULT_NAME, "-p", "hi", "--draft", "ngram", "--draft-max", "63", "--no-history")
    assert big.exit_code != 0 and big.stderr.startswith("error: --draft-max must be at most 62, not 63"), big.stderr
    assert big.stderr.count("\n") == 1, big.stderr

    async def run():
        app = make(initial="chat")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            out = []
            for typed in ("four", "-3"):
                await _settings(pilot, scr, draft_max=typed)
                await type_text(pilot, "Hello there")
                await pilot.press("enter")
                await pilot.pause(0.3)
                out.append(
                    dict(
                        notices=list(app.notices),
                        box=scr.query_one("#chat-input", Input).value,
                        sent=len(scr.query(".msg-user")),
                        generating=scr.generating,
                        session=scr.session,
                    )
                )
                app.notices.clear()
                await fill_in(pilot, scr.query_one("#chat-input", Input), "")
            return out

    words, negative = asyncio.run(run())
    for seen, line in (
        (words, "settings: Draft length: a whole number, not 'four'"),
        (negative, f"settings: {neg_line}"),
    ):
        assert [m for s, m in seen["notices"] if s == "warning"] == [line], seen["notices"]
        # nothing sent, nothing loaded: the message waits in the box
        assert seen["box"] == "Hello there" and seen["sent"] == 0 and not seen["generating"] and seen["session"] is None


def test_draft_model_auto_without_a_smaller_model_fails_that_message_in_one_line(default_model):
    from textual.widgets import Select

    async def run():
        app = make(initial="chat")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await settled(pilot)
            await pilot.press("ctrl+t")
            await pick(pilot, scr.query_one("#set-draft", Select), "model")
            picker = scr.query_one("#set-draft-model", Select)
            offered = [v for _, v in picker._options]
            await pilot.press("ctrl+l")
            await type_text(pilot, "Hello")
            await pilot.press("enter")
            await wait_for(pilot, lambda: not scr.generating and scr.query(".msg-error"), 120, "the failure")
            return offered, picker.disabled, app.notices, [str(w.render()) for w in scr.query(".msg-error")], scr.session

    offered, disabled, notices, failed, session = asyncio.run(run())
    # the store's models, after the CLI's `auto`, picked by default
    assert offered == ["auto", DEFAULT_NAME] and not disabled
    # the core's one line (the store holds no smaller model of the same vocabulary), and nothing left loaded
    (err,) = errors_in(notices)
    assert err.startswith("chat: --draft auto found no draft model for") and "\n" not in err, err
    assert failed == [f"[failed: {err.removeprefix('chat: ')}]"] and session is None
