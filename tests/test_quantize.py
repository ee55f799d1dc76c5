"""edgellm quantize on the real default model: levels, outputs, lineage, kills, refusals."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from support.helpers import DEFAULT_NAME, CancelAfter, assert_refused, start_cli, store_snapshot
from support.quant_fixtures import F16_NAME, wait_for_partial

FOUR = ["q4_0", "q4_k_m", "q5_k_m", "q8_0"]


# -- the main path: F16 -> four levels ----------------------------------------


def test_four_levels_load_generate_and_list_lineage(cli, f16_model, edgellm_home):
    from edgellm.engine.runtime import Runtime, RuntimeOptions, SamplingParams
    from edgellm.models.store import Store

    res = cli("quantize", F16_NAME, *[a for lv in FOUR for a in ("--level", lv.upper())], "--threads", "2", "--json")
    assert res.exit_code == 0, res
    out = res.json()
    assert [o["level"] for o in out] == FOUR
    by = {o["level"]: o for o in out}
    for o in out:
        for key in ("level", "path", "size_bytes", "bpw", "tensor_types", "fallback_tensors", "seconds"):
            assert key in o
        assert o["name"] == f"smollm2-135m-instruct-{o['level']}"
        assert os.path.getsize(o["path"]) == o["size_bytes"]
        assert sum(o["tensor_types"].values()) == 272 and o["tensor_types"]["F32"] == 61
        assert o["parent"] == F16_NAME and o["seconds"] > 0
    # SmolLM2 is 576 wide: the K-quants' 256-blocks do not fit 6 of each layer's
    # 7 matrices (30 layers x q, k, v, o, gate, up = 180 of 272 tensors)
    assert by["q4_k_m"]["fallback_tensors"] == by["q5_k_m"]["fallback_tensors"] == 180
    assert sum(by["q4_k_m"]["fallbacks"].values()) == 180
    assert by["q4_k_m"]["fallbacks"]["Q4_K->Q5_0"] > 0 and by["q5_k_m"]["fallbacks"]["Q5_K->Q5_1"] > 0
    assert by["q8_0"]["fallback_tensors"] == 0 and by["q8_0"]["tensor_types"] == {"F32": 61, "Q8_0": 211}
    # ... which is why its Q4_K_M is larger than its Q4_0
    assert by["q4_0"]["size_bytes"] < by["q4_k_m"]["size_bytes"] < by["q5_k_m"]["size_bytes"] < by["q8_0"]["size_bytes"]
    assert 4.5 < by["q4_0"]["bpw"] < by["q4_k_m"]["bpw"] < by["q8_0"]["bpw"] < 8.6

    for o in out:
        rt = Runtime(o["path"], RuntimeOptions(n_ctx=128, n_threads=2))
        try:
            toks = rt.tokenize("The capital of France is")
            text = "".join(rt.stream(toks, SamplingParams(temperature=0.0, max_tokens=4, seed=1)))
        finally:
            rt.close()
        assert text.strip(), o["level"]

    models = {m["name"]: m for m in cli("models", "list", "--json").json()["models"]}
    for lv in FOUR:
        m = models[f"smollm2-135m-instruct-{lv}"]
        assert m["parent"] == F16_NAME and m["level"] == lv and m["source"] == "quantize"
    assert models[F16_NAME]["parent"] == DEFAULT_NAME
    # the quality evaluation must know the base was itself dequantized from q4_1
    assert Store().get("smollm2-135m-instruct-q4_k_m").extra["base_dequantized_from"] == "q4_1"

    # text report explains the fallback
    assert_refused(cli, edgellm_home, "quantize", F16_NAME, "--level", "q4_k_m", says="already exists")
    res = cli("quantize", F16_NAME, "--level", "q4_k_m", "--force", "--threads", "2")
    assert res.exit_code == 0, res
    assert "180 of 272 tensors" in res.stdout and "576" in res.stdout and "Q5_0" in res.stdout
    # same library, same parameters: deterministic bytes
    from pathlib import Path

    from edgellm.fsutil import sha256_file

    assert sha256_file(Path(by["q4_k_m"]["path"])) == by["q4_k_m"]["sha256"]


# -- kill, cancel -------------------------------------------------------------


def test_kill9_mid_quantize_leaves_nothing_and_rerun_succeeds(cli, f16_model, edgellm_home):
    import psutil

    before = store_snapshot(edgellm_home)
    # two levels: they run side by side, one worker process each
    proc = start_cli("quantize", F16_NAME, "--level", "q8_0", "--level", "q5_k_m", "--threads", "2", "--no-progress")
    partial = wait_for_partial(edgellm_home / "models", proc, min_bytes=1 << 20)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) == 2, "each level runs in a child process of its own"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "the workers must die with their parent"
    assert partial.name.endswith(".partial")
    # the next start removes the dead job's temp file; nothing was registered
    res = cli("models", "list", "--json")
    assert res.exit_code == 0
    assert not list(edgellm_home.rglob("*.partial"))
    names = {m["name"] for m in res.json()["models"]}
    assert not names & {"smollm2-135m-instruct-q8_0", "smollm2-135m-instruct-q5_k_m"}
    assert store_snapshot(edgellm_home) == before
    res = cli("quantize", F16_NAME, "--level", "q8_0", "--threads", "2", "--json")
    assert res.exit_code == 0, res
    assert res.json()[0]["tensor_types"] == {"F32": 61, "Q8_0": 211}


def test_sigterm_cancels_cleanly(f16_model, edgellm_home):
    before = store_snapshot(edgellm_home)
    proc = start_cli("quantize", F16_NAME, "--level", "q5_k_m", "--level", "q6_k", "--threads", "2", "--no-progress")
    wait_for_partial(edgellm_home / "models", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: cancelled") and "Traceback" not in err
    assert not list(edgellm_home.rglob("*.partial"))  # at once, not only at the next start
    assert store_snapshot(edgellm_home) == before


def test_cancel_token_stops_the_worker(f16_model, edgellm_home):
    from edgellm.errors import Cancelled
    from quant.quantize import quantize

    stop = CancelAfter(30)
    before = store_snapshot(edgellm_home)
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        quantize(F16_NAME, ["q6_k"], threads=1, on_progress=stop, cancel=stop.token)
    assert time.monotonic() - t0 < 60
    assert 30 <= max(stop.seen) < 272  # per-tensor progress, stopped mid-way
    assert store_snapshot(edgellm_home) == before


def test_prestarted_worker_is_taken_and_a_dead_one_replaced(f16_model, edgellm_home, tmp_path, monkeypatch):
    """The CLI starts a worker before it has checked anything (quant._workers.prestart);
    quantize() takes that one instead of starting another, and starts a fresh one if
    the spare died meanwhile. Either way the file is the same."""
    from quant import _workers
    from quant.quantize import quantize

    started = []
    real_init = _workers.Worker.__init__
    monkeypatch.setattr(_workers.Worker, "__init__", lambda self, *a: (started.append(a), real_init(self, *a))[1])
    _workers.prestart()
    spare = _workers._spares[0]
    first = quantize(F16_NAME, "q8_0", output=tmp_path / "a.gguf", threads=2, force=True)[0]
    assert len(started) == 1 and not _workers._spares  # the spare ran the job: no second worker
    assert spare.proc.poll() is not None  # and was stopped with it
    _workers.prestart()
    dead = _workers._spares[0]
    dead.proc.kill()
    dead.proc.wait()
    second = quantize(F16_NAME, "q8_0", output=tmp_path / "b.gguf", threads=2, force=True)[0]
    assert len(started) == 3 and not _workers._spares
    assert first.sha256 == second.sha256


def test_levels_side_by_side_match_one_at_a_time(f16_model, edgellm_home, tmp_path, monkeypatch):
    """Two levels share the threads side by side; the files are those of one level at a time,
    which is also what a machine without RAM for two gets."""
    from edgellm.fsutil import sha256_file
    from quant.quantize import quantize

    side, alone = tmp_path / "side", tmp_path / "alone"
    side.mkdir()
    alone.mkdir()
    seen = []
    both = quantize(F16_NAME, ["q8_0", "q4_0"], threads=2, output=side, on_progress=seen.append)
    assert [r.level for r in both] == ["q8_0", "q4_0"]  # the order asked, whichever finished first
    assert [r.threads for r in both] == [1, 1]
    assert seen[-1].done == seen[-1].total == 2 * 272
    assert any(p.message.startswith("q8_0:") for p in seen) and any(p.message.startswith("q4_0:") for p in seen)
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(256 << 20))  # too little for two at once
    one = quantize(F16_NAME, ["q8_0", "q4_0"], threads=2, output=alone, force=True)
    assert [r.threads for r in one] == [2, 2]
    for a, b in zip(both, one):
        assert a.path.parent == side and b.path.parent == alone
        assert sha256_file(a.path) == sha256_file(b.path) == a.sha256 == b.sha256
    assert not list(tmp_path.rglob("*.partial"))


# -- refusals -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--level", "q9_z"], "unknown level"),
        (["--level", "f16"], "already f16"),
        (["--level", "iq2_xs"], "importance matrix"),
        ([], "at least one level"),
        (["--level", "q4_0", "--threads", "0"], "--threads"),
        (["--level", "q4_0", "--jobs", "0"], "--jobs"),
    ],
)
def test_bad_levels_refused(cli, f16_model, edgellm_home, args, needle):
    assert_refused(cli, edgellm_home, "quantize", F16_NAME, *args, says=needle)


def test_text_file_refused(cli, edgellm_home, tmp_path):
    text = tmp_path / "readme.gguf"
    text.write_text("hello, I am not a model\n" * 100)
    assert_refused(cli, edgellm_home, "quantize", str(text), "--level", "q4_0", says="not a GGUF")


def test_requantize_needs_flag_and_warns(cli, cli_subprocess, default_model, edgellm_home):
    assert_refused(cli, edgellm_home, "quantize", DEFAULT_NAME, "--level", "q4_0", says=["--allow-requantize", "compound"])
    res = cli_subprocess("quantize", DEFAULT_NAME, "--level", "q4_0", "--allow-requantize", "--threads", "2", "--json")
    assert res.exit_code == 0, res
    out = res.json()[0]
    assert "compound" in " ".join(out["warnings"]) and "compound" in res.stderr
    assert out["input_level"] == "q4_1" and out["parent"] == DEFAULT_NAME


def _read_only_folder(path):
    """A folder this process cannot write to, even as root (a read-only tmpfs)."""
    import subprocess

    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"running as root without permission to mount a read-only tmpfs: {r.stderr.strip()}")
    return lambda: subprocess.run(["umount", str(path)], check=False)


def test_read_only_output_folder(cli, f16_model, edgellm_home, tmp_path):
    ro = tmp_path / "ro"
    undo = _read_only_folder(ro)
    try:
        assert_refused(
            cli,
            edgellm_home,
            "quantize",
            F16_NAME,
            "--level",
            "q4_0",
            "-o",
            str(ro / "out.gguf"),
            says="cannot write to the output folder",
        )
        assert list(ro.iterdir()) == []
    finally:
        undo()


def test_full_disk_preflight_names_the_model_and_the_levels(cli, f16_model, edgellm_home, monkeypatch):
    from edgellm.fsutil import DISK_MARGIN, human_size
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.store import Store
    from quant.levels import estimate_size, parse_level

    free = 50 << 20
    monkeypatch.setenv("EDGELLM_FAKE_FREE_BYTES", str(free))
    info = read_gguf(f16_model.path)
    # each level has its own folder; the first one checked is q4_0's, with its own estimate
    need = estimate_size(info, parse_level("q4_0")) + DISK_MARGIN
    folder = Store().models_dir / "smollm2-135m-instruct-q4_0"
    res = assert_refused(cli, edgellm_home, "quantize", F16_NAME, "--level", "q4_0", "--level", "q8_0", says="not enough disk")
    # the whole line: the model by its store name and both levels (a reused name once made it "None")
    want = (
        f"error: not enough disk for quantizing {F16_NAME} to q4_0, q8_0: need {human_size(need)} "
        f"(incl. {human_size(DISK_MARGIN)} margin) in {folder}, {human_size(free)} free"
    )
    assert res.stderr.strip() == want


def test_real_file_size_limit(f16_model, edgellm_home):
    """A real write failure half-way (RLIMIT_FSIZE in the child): one line, nothing kept."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, 20 << 20))

    before = store_snapshot(edgellm_home)
    # two levels side by side: the first failure stops the other worker too
    proc = start_cli(
        "quantize", F16_NAME, "--level", "q8_0", "--level", "q4_0", "--threads", "2", "--no-progress", preexec_fn=limit
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "could not write" in lines[0], err
    assert not list(edgellm_home.rglob("*.partial"))
    assert store_snapshot(edgellm_home) == before


def test_output_path_and_json_shape(cli, f16_model, edgellm_home, tmp_path):
    target = tmp_path / "exports" / "tiny.gguf"
    target.parent.mkdir()
    res = cli("quantize", F16_NAME, "-l", "q4_0", "-o", str(target), "--threads", "2", "--json")
    assert res.exit_code == 0, res
    o = res.json()[0]
    assert o["path"] == str(target) and target.is_file()
    assert not list(target.parent.glob("*.partial"))
    assert json.loads(json.dumps(o))["fallback_tensors"] == 1  # the tied embedding: Q6_K -> Q8_0
    from edgellm.models.store import Store

    rec = Store().get("smollm2-135m-instruct-q4_0")
    assert rec.path == target and rec.parent == F16_NAME


def test_outputs_are_written_back_as_they_grow_without_waiting(tmp_path):
    """The quantize loop starts the growing outputs' write-back (sync_file_range WRITE on Linux) instead
    of fsyncing them: a full fsync every 0.25 s made llama.cpp's own writes wait (docs/scale.md)."""
    import sys

    from edgellm import fsutil

    out = tmp_path / "growing.gguf"
    data = os.urandom(1 << 20)
    out.write_bytes(data)
    start = fsutil._sync_file_range()
    if not sys.platform.startswith("linux"):
        assert start is None and fsutil.sync_soon([out]) is None
        return
    assert start is not None
    fd = os.open(out, os.O_RDONLY)
    try:
        assert start(fd, 0, 0, fsutil._SYNC_FILE_RANGE_WRITE) == 0  # the binding's arguments are right
    finally:
        os.close(fd)
    t = fsutil.sync_soon([out, tmp_path / "missing.gguf"])  # a level not started yet is skipped
    assert t is not None
    t.join(10)
    assert not t.is_alive() and out.read_bytes() == data
