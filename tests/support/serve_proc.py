"""`edgellm serve` in a child process: started on an ephemeral loopback port,
its URL read from the line it prints, stopped as Ctrl-C or a service
manager would. Shared by tests/test_server.py and scripts/load_test_server.py
(which puts tests/ on sys.path), so both read that line one way.

No edgellm import here: the script loads this before anything heavy.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)/v1")


def start_serve(*args, env: dict | None = None, cwd: Path | str | None = None) -> tuple[subprocess.Popen, str]:
    """`edgellm serve ARGS --port 0` and the base URL (http://127.0.0.1:PORT) it says it listens on.
    Raises RuntimeError with the server's own words when it does not start."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellm.cli", "serve", *map(str, args), "--port", "0"],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    m = LISTENING.search(line)
    if not m:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line.strip()} {proc.stderr.read().strip()}")
    return proc, m.group(1)


def stop_process(proc: subprocess.Popen | None, timeout: float = 30) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within `timeout` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
