"""The TUI's GPU and RPC settings (issues 17 and 19), driven with Textual's pilot on the real app:
the System screen's device list and a real `edgellm worker` probed on a loopback port (and a
closed port's reason), then Chat and Bench with GPU layers 0 and the model split onto that worker.

One worker for the module, at 1 thread: on a 2-core machine more would measure the scheduler.
"""

from __future__ import annotations

import asyncio

import pytest
from support.helpers import DEFAULT_NAME
from support.tui_pilot import SIZE, errors_in, make, pinned_ram, screen_text, settled, squeeze, type_text, wait_for  # noqa: F401
from test_rpc import Worker, free_port


@pytest.fixture(scope="module")
def worker():
    w = Worker("--mem", "1GiB")
    yield w
    rc, err = w.stop()
    assert rc == 0 and "edgellm worker: stopped" in err, (rc, err)


async def _configure(pilot, app, workers: str) -> None:
    """Enter the workers on the System screen as a user would, and wait for the probe."""
    from textual.widgets import Input

    if type(app.screen).__name__ != "SystemScreen":
        await pilot.press("f6")
        await settled(pilot)
    box = app.screen.query_one("#rpc-workers", Input)
    box.focus()
    box.value = ""
    await type_text(pilot, workers)
    await pilot.press("enter")
    await settled(pilot)


def test_system_screen_lists_devices_and_probes_workers(worker):
    from textual.widgets import DataTable, Static

    from edgellm.engine.gpu import device_lines, gpu_backends
    from edgellm.engine.rpc import local_version

    closed = free_port()

    async def run():
        app = make(initial="system")
        async with app.run_test(size=SIZE) as pilot:
            scr = app.screen
            await pilot.press("d")
            await settled(pilot)
            devices = str(scr.query_one("#gpu-devices", Static).render())
            await _configure(pilot, app, f"{worker.address},127.0.0.1:{closed}")
            table = scr.query_one("#rpc-table", DataTable)
            rows = {key.value: table.get_row(key) for key in table.rows}
            configured = app.rpc_workers
            shown = screen_text(app)
            assert app.focused is table  # Enter leaves the field: the screen's keys act again
            # a malformed address: its one line, and the configured list stays as it was
            await _configure(pilot, app, "nohost")
            return devices, rows, configured, shown, app.rpc_workers, app.notices

    devices, rows, configured, shown, after_bad, notices = asyncio.run(run())
    assert devices.splitlines() == device_lines()
    if not gpu_backends():  # this machine's CPU wheel
        assert devices.startswith("no GPU device: this llama.cpp build has no GPU backend (CPU-only")
    assert configured == f"{worker.address},127.0.0.1:{closed}"
    state, version, memory = rows[worker.address][1:]
    assert (state, version) == ("reachable", ".".join(map(str, local_version())))
    assert memory.startswith("1.1 GB of ")  # --mem 1GiB, as the worker offers it
    assert rows[f"127.0.0.1:{closed}"][1].startswith("connection refused (is `edgellm worker --port")
    assert "reachable" in shown and "connection refused" in shown
    assert after_bad == configured
    assert any("'nohost' is not HOST:PORT" in m for m in errors_in(notices)), notices


async def _open_over(pilot, app, workers: str, key: str):
    """The screen behind `key`, opened once `workers` are configured on the System screen."""
    await _configure(pilot, app, workers)
    await pilot.press(key)
    await settled(pilot)
    return app.screen


def _chat_over_workers(scr, settings: dict[str, str]) -> None:
    """Chat's settings as typed, the model split over the workers, and the message box focused."""
    from textual.widgets import Checkbox, Input

    for key, v in settings.items():
        scr.query_one(f"#set-{key}", Input).value = v
    scr.query_one("#set-rpc", Checkbox).value = True
    scr.query_one("#chat-input", Input).focus()


async def _reply(pilot, scr, what: str) -> None:
    """Send the typed message and wait until its reply has finished."""
    sent = len(scr.query(".msg-user"))
    await pilot.press("enter")
    # the message is mounted when the reply starts; a short reply from a loaded model can be over before the
    # first poll, so waiting to see `generating` set would wait for nothing
    await wait_for(pilot, lambda: len(scr.query(".msg-user")) > sent, 10, "generation to start")
    await wait_for(pilot, lambda: not scr.generating, 300, what)
    await pilot.pause(0.2)


def test_chat_with_gpu_layers_0_over_a_worker_replies_and_shows_the_plan(worker, default_model):
    from textual.widgets import Checkbox, Input

    from edgellm.engine.gpu import gpu_backends

    async def run():
        app = make(initial="system")
        async with app.run_test(size=SIZE) as pilot:
            scr = await _open_over(pilot, app, worker.address, "f4")
            _chat_over_workers(scr, {"gpu_layers": "lots", "threads": "1", "ctx": "512", "max_tokens": "8", "temperature": "0"})
            await type_text(pilot, "Hi")
            await pilot.press("enter")  # refused: the GPU-layers field does not parse
            await pilot.pause(0.2)
            refused = [m for _s, m in app.notices if "GPU layers" in m]
            scr.query_one("#set-gpu_layers", Input).value = "0"
            await _reply(pilot, scr, "the reply")
            plan = "\n".join(str(w.render()) for w in scr.query(".plan"))
            rpc_plan = scr.session.runtime.rpc_plan
            # then on this machine alone with GPU layers auto: a reload, and the GPU plan that ran
            scr.query_one("#set-rpc", Checkbox).value = False
            scr.query_one("#set-gpu_layers", Input).value = "auto"
            await type_text(pilot, "Hi")
            await _reply(pilot, scr, "the second reply")
            gpu = [str(w.render()) for w in scr.query(".plan")][-1]
            return refused, scr.last_reply, scr.last_stats, plan, rpc_plan, gpu, scr.session.runtime.gpu_plan, app.notices

    refused, reply, stats, plan, rpc_plan, gpu, gpu_plan, notices = asyncio.run(run())
    assert refused and "GPU layers: a number, all, auto or 0, not 'lots'" in refused[0], refused
    assert not errors_in(notices), notices
    assert reply.strip() and stats.generated_tokens > 0
    # the split ran on the worker: layers there, and the plan said so in the conversation
    assert rpc_plan is not None and [str(w.endpoint) for w in rpc_plan.workers] == [worker.address]
    assert rpc_plan.devices[1].n_layers > 0
    assert "plan: 30 layers + output over 2 devices" in plan and worker.address in plan and "RPC0" in plan
    assert gpu == gpu_plan.describe() and gpu_plan.requested == "auto"
    if not gpu_backends():  # this machine's CPU wheel: auto offloads nothing, and says why
        assert gpu.startswith("GPU offload: none (no GPU device: this llama.cpp build has no GPU backend")


def test_bench_with_gpu_layers_and_over_a_worker(worker, default_model):
    from textual.widgets import Checkbox, DataTable, Input

    from edgellm.fsutil import human_size

    async def run():
        app = make(initial="system")
        async with app.run_test(size=SIZE) as pilot:
            scr = await _open_over(pilot, app, worker.address, "f5")
            for id_, v in (("#bench-pp", "16"), ("#bench-tg", "4"), ("#bench-reps", "1"), ("#bench-gpu-layers", "0")):
                scr.query_one(id_, Input).value = v
            out = []
            for use_rpc in (False, True):
                scr.query_one("#bench-rpc", Checkbox).value = use_rpc
                await pilot.press("g")
                await wait_for(pilot, lambda: scr.token is None, 300, "the benchmark")
                await pilot.pause(0.2)
                table = scr.query_one("#bench-results", DataTable)
                out.append(
                    (
                        list(scr.rows),
                        [list(map(str, table.get_row_at(i))) for i in range(table.row_count)],
                        squeeze(screen_text(app, scr.query_one("#bench-mem"))),
                    )
                )
            return out, app.notices

    (local, split), notices = asyncio.run(run())
    assert not errors_in(notices), notices
    rows, cells, _mem = local
    assert [r["test"] for r in rows] == ["pp16", "tg4"] and all(r["n_gpu_layers"] == 0 for r in rows)
    # no layers off the host: no device bytes, and what llama.cpp allocated here
    assert [c[-3:] for c in cells] == [["0", "-", human_size(r["host_bytes"])] for r in rows]
    assert all(r["host_bytes"] > 0 for r in rows)
    rows, cells, mem = split
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    assert all(r["n_gpu_layers"] > 0 and r["device_bytes"] > 0 and r["host_bytes"] > 0 for r in rows)
    assert cells[0][-3] == str(rows[0]["n_gpu_layers"]) and cells[0][1] == "pp16"
    assert "onworkers" in mem and "network" in mem and DEFAULT_NAME[:10] in mem


def test_a_worker_killed_mid_reply_ends_that_reply_and_the_app_stays_up(default_model):
    """The CLI exits with one line when a worker dies; the TUI keeps running: the reply ends with
    that line within seconds, the worker's probe then says why, and the app still quits cleanly."""
    import time

    from textual.widgets import DataTable

    victim = Worker("--mem", "1GiB")

    async def run():
        app = make(initial="system")
        async with app.run_test(size=SIZE) as pilot:
            scr = await _open_over(pilot, app, victim.address, "f4")
            _chat_over_workers(scr, {"threads": "1", "ctx": "512", "max_tokens": "400", "temperature": "0"})
            await type_text(pilot, "Count from 1 to 300, separated by commas.")
            await pilot.press("enter")
            await wait_for(pilot, lambda: scr.last_reply, 300, "the reply to stream")
            victim.proc.kill()  # SIGKILL, as a power cut would not even give
            killed = time.monotonic()
            await wait_for(pilot, lambda: not scr.generating, 30, "the reply to end")
            took = time.monotonic() - killed
            failed = [str(w.render()) for w in scr.query(".msg-error")]
            await pilot.press("f6")
            await settled(pilot)
            await pilot.click("#rpc-probe")
            await settled(pilot)
            table = app.screen.query_one("#rpc-table", DataTable)
            state = table.get_row(victim.address)[1]
            await pilot.press("ctrl+q")
            return took, failed, state, scr.session, app.notices

    try:
        took, failed, state, session, notices = asyncio.run(run())
    finally:
        victim.stop()
    assert took < 10, took
    assert len(failed) == 1 and failed[0].startswith(f"[failed: RPC worker {victim.address} went away during a generation"), (
        failed
    )
    assert session is None  # dropped: the next message loads afresh
    assert state.startswith("connection refused")
    assert any(victim.address in m for m in errors_in(notices)), notices
