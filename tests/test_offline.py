"""No network: the whole offline path works with every connection blocked.

A child process installs a `sys.addaudithook` that records every
`socket.connect` (and `socket.getaddrinfo`, a DNS lookup) and makes the
connect fail, then calls `edgellm.cli.main([...])` for each step: import,
quantize, convert, inspect, chat -p, ppl, eval, bench, models list,
and then starts the TUI (`tui.app.make_app()` under `App.run_test()`) and
visits every screen. The same hook is installed in every Python process that
child starts (the quantize, chat, eval and bench workers) through a
`sitecustomize` on PYTHONPATH, and each process registers itself, so a
worker cannot escape the count. No offline flag is set: these commands must
simply not need the network.

Proven: every step exits 0 and zero connection attempts are recorded, in the
CLI process and in its workers; and a control step (a Hub pull) is recorded
and refused, so the hook is not blind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.gguf_files import TINY_EVAL_ARGS, write_tiny_llama
from support.helpers import WIKITEXT
from support.tui_pilot import SCREEN_CYCLE

ROOT = Path(__file__).resolve().parent.parent

NETGUARD = r'''
"""Installed in every Python process of the test: record and refuse the network."""
import json, os, sys

_LOG = os.environ["NETGUARD_LOG"]


def _write(obj):
    with open(_LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(obj) + "\n")


def _hook(event, args):
    if event == "socket.connect":
        _write({"pid": os.getpid(), "event": event, "address": repr(args[1])[:200], "step": os.environ.get("NETGUARD_STEP", "")})
        raise OSError("network blocked by tests/test_offline.py")
    if event == "socket.getaddrinfo":
        _write({"pid": os.getpid(), "event": event, "address": repr(args[:2])[:200], "step": os.environ.get("NETGUARD_STEP", "")})


if not getattr(sys, "_netguard_installed", False):
    sys._netguard_installed = True
    sys.addaudithook(_hook)
    _write({"pid": os.getpid(), "ppid": os.getppid(), "event": "guard-installed", "step": os.environ.get("NETGUARD_STEP", "")})
'''

WRAPPER = r"""
import asyncio, json, os, sys
import _netguard  # the audit hook, before edgellm is imported
from edgellm.cli import main

steps = json.loads(sys.argv[1])
results = []
for label, argv in steps:
    os.environ["NETGUARD_STEP"] = label
    results.append({"step": label, "rc": main(argv)})

os.environ["NETGUARD_STEP"] = "tui"


async def tui():
    from textual.widgets import DataTable
    from tui.app import make_app

    app = make_app(autorun=False)
    seen = []
    async with app.run_test(size=(100, 30)) as pilot:
        for key in ("f1", "f2", "f3", "f4", "f5", "f6", "f1"):
            await pilot.press(key)
            await pilot.pause()
            seen.append(type(app.screen).__name__)
        rows = [k.value for k in app.screen.query_one("#store", DataTable).rows]
        await pilot.press("ctrl+q")
    return seen, rows

seen, rows = asyncio.run(tui())
results.append({"step": "tui", "rc": 0, "screens": seen, "store_rows": rows})
with open(os.environ["NETGUARD_RESULTS"], "w") as fh:
    json.dump(results, fh)
"""


def test_offline_path_makes_no_connection(tmp_path):
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "_netguard.py").write_text(NETGUARD)
    # Every Python process started below (workers, sandboxes) imports the guard too.
    (guard_dir / "sitecustomize.py").write_text("import _netguard  # noqa: F401\n")
    log, results_file = tmp_path / "net.jsonl", tmp_path / "results.json"

    tiny = write_tiny_llama(tmp_path / "tiny-F16.gguf")
    text = tmp_path / "text.txt"
    text.write_bytes(WIKITEXT.read_bytes()[:6000])
    steps = [
        ("import", ["import", str(tiny), "--name", "tiny-f16"]),
        ("quantize", ["quantize", "tiny-f16", "--level", "q8_0", "--no-progress"]),
        ("convert", ["convert", "tiny-q8_0", "--to", "f32", "--name", "tiny-back-f32", "--no-progress"]),
        ("inspect", ["inspect", "tiny-back-f32", "--json"]),
        ("chat", ["chat", "tiny-f16", "-p", "hello", "--max-tokens", "8", "--temperature", "0", "--ctx", "256"]),
        ("ppl", ["ppl", "tiny-q8_0", "--text", str(text), *TINY_EVAL_ARGS, "--no-progress"]),
        ("eval", ["eval", "tiny-f16", "--levels", "q8_0,q4_0", "--text", str(text), *TINY_EVAL_ARGS, "--no-progress"]),
        ("bench", ["bench", "tiny-q8_0", "--pp", "16", "--tg", "4", "-r", "1", "--no-progress"]),
        ("models", ["models", "list", "--local"]),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(guard_dir), str(ROOT)]),
        NETGUARD_LOG=str(log),
        NETGUARD_RESULTS=str(results_file),
        # Where a stray call would go: a routable-looking endpoint, not an offline flag.
        HF_ENDPOINT="http://192.0.2.1:9",
    )
    for var in ("HF_HUB_OFFLINE", "EDGELLM_OFFLINE"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, json.dumps(steps)], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(results_file.read_text())
    assert [r["step"] for r in results] == [s for s, _ in steps] + ["tui"]
    assert all(r["rc"] == 0 for r in results), (results, proc.stderr[-2000:])
    tui = results[-1]
    assert tui["screens"] == SCREEN_CYCLE
    assert {"tiny-f16", "tiny-q8_0", "tiny-q4_0", "tiny-back-f32"} <= set(tui["store_rows"])

    events = [json.loads(ln) for ln in log.read_text().splitlines()]
    installed = [e for e in events if e["event"] == "guard-installed"]
    attempts = [e for e in events if e["event"] != "guard-installed"]
    assert attempts == []
    # The guard really ran in the workers too: the quantize worker (quantize, and eval's q4_0),
    # and the workers chat and bench start are all children of the CLI process.
    main_pid = installed[0]["pid"]
    worker_steps = {e["step"] for e in installed[1:] if e["ppid"] == main_pid}
    assert {"quantize", "chat", "eval", "bench"} <= worker_steps, installed


def test_the_guard_sees_a_real_attempt(tmp_path):
    """The control: a Hub pull tries to connect, is recorded and refused, and ends in one line."""
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "_netguard.py").write_text(NETGUARD)
    log = tmp_path / "net.jsonl"
    code = (
        "import sys, _netguard\nfrom edgellm.cli import main\n"
        "sys.exit(main(['pull', 'edge/tiny-GGUF', '--file', 'tiny-Q8_0.gguf']))\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(guard_dir), str(ROOT)]),
        NETGUARD_LOG=str(log),
        HF_ENDPOINT="http://127.0.0.1:9",
        EDGELLM_HUB_RETRIES="1",
        EDGELLM_HUB_BACKOFF="0.01",
    )
    for var in ("HF_HUB_OFFLINE", "EDGELLM_OFFLINE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    attempts = [json.loads(ln) for ln in log.read_text().splitlines() if '"socket.connect"' in ln]
    assert attempts and "127.0.0.1" in attempts[0]["address"] and "9" in attempts[0]["address"]
