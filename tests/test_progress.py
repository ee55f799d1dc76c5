"""Piped progress (stderr not a terminal): a line per 10% of a task, a heartbeat at most every 5 s for
a task of unknown size; and `edgellm pull` of the real default model piped to a file stays short."""

from __future__ import annotations

import io
import os
import re
import subprocess

from support.helpers import DEFAULT_REF, cli_argv, shared_cache

from edgellm.progress import Progress, TerminalBar


def test_a_piped_task_prints_a_line_per_tenth_however_many_updates():
    out = io.StringIO()
    bar = TerminalBar(out)
    for i in range(1001):
        bar(Progress("download x", i * 98_400, 98_400_000, "B"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and "100.0%" in lines[-1] and "0.0%" in lines[0]


def test_interleaved_tasks_never_repeat_a_tenth():
    """Two tasks reporting by turns (a download and its hash) used to print on every switch."""
    out = io.StringIO()
    bar = TerminalBar(out)
    for i in range(1001):
        bar(Progress("download", i, 1000, "B"))
        bar(Progress("sha256", i, 1000, "B"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 22 and sum(ln.startswith("sha256") for ln in lines) == 11


def test_an_unknown_size_is_a_heartbeat_not_a_line_per_update(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("edgellm.progress.time.monotonic", lambda: now[0])
    out = io.StringIO()
    bar = TerminalBar(out)
    for i in range(600):  # 60 s of updates, ten a second
        bar(Progress("scan", i, None, "file"))
        now[0] += 0.1
    assert len(out.getvalue().splitlines()) == 12  # at 0 s, then every 5 s


def test_pull_of_the_default_model_piped_to_a_file_writes_at_most_12_progress_lines(tmp_path):
    env = dict(os.environ, EDGELLM_HOME=str(tmp_path / "home"), EDGELLM_CACHE=str(shared_cache()))
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:  # files: no terminal
        proc = subprocess.run(cli_argv("pull", DEFAULT_REF), env=env, stdout=out, stderr=err, timeout=900)
    assert proc.returncode == 0, (tmp_path / "err.txt").read_text()[-2000:]
    lines = [ln for ln in (tmp_path / "err.txt").read_text().splitlines() if ln.strip()]
    progress = [ln for ln in lines if re.search(r"\d+\.\d%", ln)]
    assert progress == lines, lines  # stderr holds nothing but progress
    assert 1 <= len(progress) <= 12, progress
    assert "100.0%" in progress[-1]
    assert (tmp_path / "out.txt").read_text().startswith("smollm2-135m-instruct")  # the result, on stdout


def test_a_staged_job_names_its_stage_and_other_tasks_name_none():
    from edgellm.progress import Progress, staged, stage_of

    seen: list[Progress] = []
    staged(seen.append, ("measure", "calibrate", "allocate", "quantize"), "calibrate")(Progress("probe", 1, 4, "probe"))
    assert seen[0].task == "2/4 calibrate: probe" and (seen[0].done, seen[0].total) == (1, 4)
    assert stage_of(seen[0]) == "2/4 calibrate"
    # a plain task with a colon in it is not a stage
    assert stage_of(Progress("extract a: b", 0)) == "" and stage_of(Progress("1/2: x", 0)) == ""
