"""edgellm bench: llama-bench's fields and statistics, the memory split, errors, results, plot, sampler.

Real model, real llama.cpp, small tests (pp 64, tg 16, 2 repetitions). No
speed is asserted here: speed is what scripts/bench_vs_llama_bench.py is for.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
from pathlib import Path

import pytest
from support.gguf_files import write_stub_gguf
from support.helpers import DEFAULT_NAME, assert_one_line_error

SMALL = ("--pp", "64", "--tg", "16", "-r", "2", "--threads", "1", "--no-progress")


def test_the_bandwidth_probe_reads_every_byte_as_the_kernels_stream_weights():
    # scripts/patches/ggml-cpu-token-kernels.patch's stream read: the one-row kernels' prefetch, over
    # every byte (it returns the OR of the words), and the probe keeps the faster of it and memchr
    import numpy as np

    from edgellm.engine import backends
    from edgellm.profile.bench import measure_bandwidth_now

    addr = backends.cpu_proc("ggml_backend_cpu_stream_read")
    assert addr, "this build lacks scripts/patches"
    read = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)(addr)
    buf = np.zeros(1 << 20, np.uint8)
    assert read(buf.ctypes.data, buf.size) == 0
    buf[777_777] = 0x5A
    assert read(buf.ctypes.data, buf.size) == 0x5A << (8 * (777_777 % 8))
    bw = measure_bandwidth_now(threads=1, size_bytes=64 << 20, repeats=1)
    assert bw.reader in ("memchr", "ggml") and bw.read_bytes_per_s > 1e8


def _vma(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds addr."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="huge pages are Linux's")
def test_big_ggml_buffers_ask_for_huge_pages():
    # scripts/patches/ggml-huge-pages.patch: ggml's big buffers (the weights a CPU repacks, a --no-mmap
    # load) are 2 MiB-aligned and advised MADV_HUGEPAGE, so generation streams them without a TLB miss
    # every 4 KiB; the advice shows as "hg" in the mapping's VmFlags whatever the system's THP mode. (A
    # small buffer is not asserted free of it: the heap can hand it a range an earlier big one advised.)
    from edgellm.engine import backends
    from edgellm.engine.hardware import huge_pages_mode

    lib = backends.lib_dir()
    assert lib is not None
    base = ctypes.CDLL(str(lib / "libggml-base.so.0"))
    base.ggml_aligned_malloc.restype, base.ggml_aligned_malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    base.ggml_aligned_free.restype, base.ggml_aligned_free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t]
    big_n, small_n = 16 << 20, 64 << 10
    big, small = base.ggml_aligned_malloc(big_n), base.ggml_aligned_malloc(small_n)
    try:
        assert big % (2 << 20) == 0 and small % 64 == 0
        ctypes.memset(big, 1, big_n)
        vma = _vma(big)
        assert "hg" in vma["VmFlags"].split(), vma["VmFlags"]
        mode = huge_pages_mode()
        if mode != "never":  # then the kernel backs the touched, aligned 2 MiB ranges with huge pages
            assert int(vma["AnonHugePages"].split()[0]) >= 2048, (mode, vma["AnonHugePages"])
    finally:
        base.ggml_aligned_free(big, big_n)
        base.ggml_aligned_free(small, small_n)


@pytest.fixture(scope="module")
def q8_gguf(default_gguf, tmp_path_factory) -> Path:
    """The default model requantized to Q8_0 with llama.cpp's own quantizer (ftype 7)."""
    import llama_cpp

    out = tmp_path_factory.mktemp("q8") / "smollm2-135m-instruct-q8_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(default_gguf).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0 and out.is_file()
    return out


def test_json_rows_use_llama_bench_fields(cli, default_model, edgellm_home):
    res = cli("bench", DEFAULT_NAME, *SMALL, "--json")
    assert res.exit_code == 0, res
    rows = res.json()
    assert [r["test"] for r in rows] == ["pp64", "tg16"]
    for r in rows:
        for key in (
            "model_filename",
            "n_prompt",
            "n_gen",
            "n_threads",
            "avg_ts",
            "stddev_ts",
            "test",
            "rss_bytes",
            "file_backed_bytes",
            "anon_bytes",
            "kv_bytes",
            "load_seconds",
            "ttft_seconds",
            "samples_ns",
            "samples_ts",
        ):
            assert key in r, key
        assert r["model"] == DEFAULT_NAME and r["model_type"] == "q4_1"
        assert Path(r["model_filename"]) == default_model.path
        assert r["n_threads"] == 1 and len(r["samples_ns"]) == 2
        assert r["avg_ts"] > 0 and r["stddev_ts"] >= 0
        # llama-bench's avg_ts is the mean of per-repetition tokens/s
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2, rel=1e-9)
        assert r["load_seconds"] > 0 and 0 < r["ttft_seconds"] < 60
        assert r["rss_bytes"] > r["file_backed_bytes"] > 0
        # f16 K and V, 30 layers x 3 KV heads x 64 dims, at the context llama.cpp created
        assert r["kv_bytes"] == 2 * 30 * r["n_ctx"] * 3 * 64 * 2
    pp, tg = rows
    assert (pp["n_prompt"], pp["n_gen"], tg["n_prompt"], tg["n_gen"]) == (64, 0, 0, 16)
    # the roofline: bandwidth / the bytes a token reads, and the fraction tg reached of it. The default
    # model is tied (its embedding is the output matrix: read whole), plus the K and V cells of the
    # 15/2 tokens before the average one
    assert tg["bandwidth_bytes_per_s"] > 1e8
    assert tg["read_bytes_per_token"] == int(tg["model_size"] + 2 * 30 * 3 * 64 * 2 * 15 / 2)
    assert tg["roofline_ts"] == pytest.approx(tg["bandwidth_bytes_per_s"] / tg["read_bytes_per_token"])
    assert tg["roofline_fraction"] == pytest.approx(tg["avg_ts"] / tg["roofline_ts"])
    assert pp["roofline_ts"] is None

    # saved per model and machine, atomically, and readable back
    from edgellm.profile.results import load_bench_results, machine_id

    saved = list((edgellm_home / "results" / "bench").iterdir())
    assert [p.name for p in saved] == [f"{DEFAULT_NAME}-{machine_id()}.json"]
    # the roofline's bandwidth: the mean of a probe before the model's runs and one right after them
    probes = json.loads(saved[0].read_text())["bandwidth"]
    assert len(probes["samples"]) == 2 and min(probes["samples"]) > 1e8
    assert tg["bandwidth_bytes_per_s"] == pytest.approx(sum(probes["samples"]) / 2) == probes["read_bytes_per_s"]
    back = load_bench_results(DEFAULT_NAME)
    assert [(b["test"], b["avg_ts"]) for b in back] == [(r["test"], r["avg_ts"]) for r in rows]
    assert load_bench_results("some-other-model") == []


def test_stats_match_llama_bench_formula():
    from edgellm.profile._worker import stats_ts

    # 64 tokens in 0.5 s, 0.25 s, 1 s -> 128, 256, 64 t/s
    avg, sd = stats_ts([500_000_000, 250_000_000, 1_000_000_000], 64)
    assert avg == pytest.approx((128 + 256 + 64) / 3)
    import statistics

    assert sd == pytest.approx(statistics.stdev([128, 256, 64]), rel=1e-9)  # sample sd (n - 1), as llama-bench
    assert stats_ts([500_000_000], 64) == (128.0, 0.0)


def test_memory_split_q8_0_mmap_vs_no_mmap(q8_gguf):
    from edgellm.profile.bench import bench
    from edgellm.profile.settings import BenchSettings

    size = q8_gguf.stat().st_size
    settings = BenchSettings(pp=64, tg=16, repetitions=1, threads=1, n_ctx=1024)
    rows = bench([q8_gguf], settings, measure_bandwidth=False, save=False)
    tg = rows[1]
    assert tg.test == "tg16" and tg.n_ctx == 1024
    # mmapped: the weights are resident file-backed pages, about the file's size
    assert abs(tg.file_backed_bytes - size) <= 0.10 * size, (tg.file_backed_bytes, size)
    # anonymous: the KV cache (f16, 1024 ctx: 23.6 MB) plus compute/output buffers and llama.cpp's bookkeeping
    assert tg.kv_bytes == 2 * 30 * 1024 * 3 * 64 * 2
    assert tg.kv_bytes <= tg.anon_bytes <= tg.kv_buffer_bytes + tg.compute_buffer_bytes + tg.output_buffer_bytes + (32 << 20), tg
    assert tg.anon_bytes < 0.5 * size
    assert tg.rss_bytes >= tg.file_backed_bytes + tg.anon_bytes

    rows = bench([q8_gguf], settings, use_mmap=False, measure_bandwidth=False, save=False)
    tg2 = rows[1]
    # no mmap: the split flips; the weights are private anonymous memory, nothing of the file stays mapped
    assert tg2.anon_bytes >= size, (tg2.anon_bytes, size)
    assert tg2.anon_bytes >= tg.anon_bytes + 0.9 * size
    assert tg2.file_backed_bytes < 0.05 * size
    assert tg2.use_mmap is False


def test_text_csv_md_and_plot(cli, default_model, tmp_path):
    plot = tmp_path / "tps.png"
    res = cli("bench", DEFAULT_NAME, "--pp", "32", "--tg", "8", "-r", "1", "--threads", "1", "--no-progress", "--plot", plot)
    assert res.exit_code == 0, res
    assert DEFAULT_NAME in res.stdout and "pp32" in res.stdout and "tg8" in res.stdout and "roofline" in res.stdout
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert w >= 200 and h >= 200
    assert not list(tmp_path.glob("*.partial"))

    res = cli("bench", DEFAULT_NAME, "--pp", "16", "--tg", "0", "-r", "1", "--threads", "1", "--csv")
    assert res.exit_code == 0, res
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("model,model_filename,") and len(lines) == 2 and ",pp16,16,0,1," in lines[1]

    res = cli("bench", DEFAULT_NAME, "--pp", "16", "--tg", "0", "-r", "1", "--threads", "1", "--md")
    assert res.exit_code == 0, res
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("| model |") and lines[1].startswith("|---") and "pp16" in lines[2]


def test_compare_llama_bench(cli, default_model, llama_tools, monkeypatch):
    # the same llama-bench the ratio script uses
    monkeypatch.setenv("EDGELLM_LLAMA_TOOLS", str(llama_tools))
    res = cli("bench", DEFAULT_NAME, "--pp", "32", "--tg", "8", "-r", "1", "--threads", "1", "--json", "--compare-llama-bench")
    assert res.exit_code == 0, res
    for r in res.json():
        assert r["llama_bench_ts"] > 0
        assert r["ratio"] == pytest.approx(r["avg_ts"] / r["llama_bench_ts"])


def test_errors_are_one_line(cli, default_model, tmp_path, edgellm_home):
    for args in (["--pp", "0"], ["--pp", "-5"], ["--ctx", "32", "--pp", "64"], ["--tg", "-1"], ["-r", "0"]):
        res = cli("bench", DEFAULT_NAME, *args, "--no-progress")
        assert_one_line_error(res)
    assert "--pp must be at least 1" in cli("bench", DEFAULT_NAME, "--pp", "0").stderr
    assert "smaller than --pp 64" in cli("bench", DEFAULT_NAME, "--ctx", "32", "--pp", "64").stderr

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    assert_one_line_error(cli("bench", garbage))

    # a well-formed GGUF that llama.cpp refuses: llama.cpp's own reason reaches the user
    alien = write_stub_gguf(tmp_path / "alien.gguf", arch="alienarch", layers=1)
    res = cli("bench", alien, "--pp", "8", "--tg", "4", "-r", "1", "--no-progress")
    assert_one_line_error(res)
    assert "alienarch" in res.stderr
    assert_one_line_error(cli("bench", "no-such-model"))
    assert not (edgellm_home / "results" / "bench").exists() or not list((edgellm_home / "results" / "bench").iterdir())


def test_cancel_stops_the_child(default_gguf):
    import psutil

    from edgellm.errors import Cancelled
    from edgellm.profile.bench import bench
    from edgellm.profile.settings import BenchSettings
    from edgellm.progress import CancelToken

    token = CancelToken()
    seen: list = []

    def on_progress(p):
        seen.append(p)
        token.cancel("stop")

    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(Cancelled):
        bench(
            [default_gguf],
            BenchSettings(pp=16, tg=512, repetitions=50, threads=1),
            measure_bandwidth=False,
            on_progress=on_progress,
            cancel=token,
        )
    assert seen
    left = []
    for c in psutil.Process().children():
        try:
            if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE:
                left.append(c)
        except psutil.NoSuchProcess:
            pass
    assert not left, left


def test_live_sampler_rate_and_rss():
    import psutil

    from edgellm.profile.live import LiveSampler

    with LiveSampler(interval=0.05, window=5.0) as s:
        for _ in range(11):
            s.tokens(1)
            time.sleep(0.02)
        time.sleep(0.15)
        snap = s.snapshot()
    assert snap.tokens == 11
    # 10 intervals of >= 20 ms between the first and last token: at most 50 tokens/s
    assert 0 < snap.tokens_per_second <= 50.5
    assert snap.samples and all(rss > 0 for _, _, rss in snap.samples)
    assert abs(snap.rss_bytes - psutil.Process().memory_info().rss) < 64 << 20
    assert snap.peak_rss_bytes >= max(rss for _, _, rss in snap.samples)
    json.dumps(snap.to_json())


def test_draft_rows_report_effective_speed_and_counters_that_add_up(cli, default_model):
    res = cli("bench", DEFAULT_NAME, "--pp", "16", "--tg", "64", "-r", "2", "--threads", "2", "--draft", "ngram", "--json")
    assert res.exit_code == 0, res.stderr
    rows = {r["test"]: r for r in res.json()}
    plain, spec = rows["tg64@rewrite"], rows["tg64@rewrite+ngram"]
    assert {"pp16", "tg64"} <= set(rows)  # the llama-bench rows are still there
    assert plain["extra"]["drafted"] == 0 and plain["extra"]["draft"] == "off"
    x = spec["extra"]
    assert x["draft"] == "ngram" and x["same_reply_as_plain"] is True  # lossless
    assert len(x["reps"]) == 2 and spec["avg_ts"] > 0 and plain["avg_ts"] > 0
    for key, rep_key in (("drafted", "drafted"), ("accepted", "accepted"), ("draft_steps", "steps")):
        assert x[key] == sum(r[rep_key] for r in x["reps"])
    assert 0 < x["accepted"] <= x["drafted"]  # a rewrite repeats its prompt: drafts are made and taken
    assert abs(x["accept_rate"] - x["accepted"] / x["drafted"]) < 1e-12
    for r in x["reps"]:
        assert abs(r["tokens_per_s"] - r["generated"] / r["seconds"]) < 1e-6 * r["tokens_per_s"]
    bad = cli("bench", DEFAULT_NAME, "--pp", "16", "--tg", "8", "-r", "1", "--draft", "no-such-model", "--no-progress")
    assert bad.exit_code != 0 and "error:" in bad.stderr and "Traceback" not in bad.stderr
