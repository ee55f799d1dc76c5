#!/usr/bin/env python3
"""Feed malformed GGUF files to edgellm's commands; every run must end in a
one-line error with exit != 0 — no traceback, no signal, no hang.

    .venv/bin/python scripts/fuzz_gguf.py --count 500            # the full run
    .venv/bin/python scripts/fuzz_gguf.py --count 40 --json      # a slice

Cases are made from two sources: a tiny float llama written with gguf-py
(tests/support/gguf_files.py; cheap, so most cases) and the real default model
(SmolLM2-135M Q4_1, if pulled; a few dozen cases). Mutations: truncation at
every structure boundary, bad magic/versions, absurd tensor/KV counts, string
and array lengths past EOF, tensor dims/types/offsets out of range or
misaligned, metadata that contradicts the tensors (block count 0 and 999,
embedding length, head counts, vocab size), NaN/Inf weights, duplicate names.

Commands run in a worker process, many files per worker, through the real
CLI; a worker killed by a signal is reported with the file and command that
killed it and replaced by a fresh one. Exit status: 0 when every run ended in
a clean one-line error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

COMMANDS = {
    "inspect": ["inspect", "{f}"],
    "import": ["import", "{f}", "--name", "fuzz-{i}"],
    "quantize": ["quantize", "{f}", "--level", "q8_0", "--allow-requantize", "-o", "{tmp}/out-{i}.gguf"],
    "ppl": ["ppl", "{f}", "--text", "{text}", "--ctx", "64", "--chunks", "1"],
    "chat": ["chat", "{f}", "-p", "hi", "--max-tokens", "4", "--temperature", "0"],
}


# -- the structure of a well-formed file ------------------------------------


@dataclass
class Layout:
    size: int
    n_tensors_off: int = 8
    n_kv_off: int = 16
    kvs: list[dict] = field(default_factory=list)  # {key, start, type_off, value_off, count_off?, end}
    tensors: list[dict] = field(default_factory=list)  # {name, start, ndims_off, dims_off, type_off, offset_off, end, rel}
    data_start: int = 0


def walk(data: bytes) -> Layout:
    lay = Layout(len(data))
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(p):
        n = struct.unpack_from("<Q", data, p)[0]
        return data[p + 8 : p + 8 + n].decode("utf-8", "replace"), p + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        t = struct.unpack_from("<I", data, pos)[0]
        kv = {"key": key, "start": start, "type_off": pos, "value_off": pos + 4, "type": t}
        pos += 4
        if t in sizes:
            pos += sizes[t]
        elif t == 8:
            _, pos = string(pos)
        else:
            et, count = struct.unpack_from("<IQ", data, pos)
            kv["count_off"] = pos + 4
            kv["elem_type"] = et
            pos += 12
            if et == 8:
                kv["first_str_off"] = pos
                for _i in range(count):
                    _, pos = string(pos)
            else:
                pos += sizes[et] * count
        kv["end"] = pos
        lay.kvs.append(kv)
    for _ in range(n_tensors):
        start = pos
        name, pos = string(pos)
        nd = struct.unpack_from("<I", data, pos)[0]
        t = {"name": name, "start": start, "ndims_off": pos, "dims_off": pos + 4, "ndims": nd}
        pos += 4 + 8 * nd
        t["type_off"] = pos
        t["type"] = struct.unpack_from("<I", data, pos)[0]
        t["offset_off"] = pos + 4
        t["rel"] = struct.unpack_from("<Q", data, pos + 4)[0]
        pos += 12
        t["end"] = pos
        lay.tensors.append(t)
    lay.data_start = (pos + 31) // 32 * 32
    return lay


# -- mutations --------------------------------------------------------------


@dataclass
class Case:
    name: str
    source: str  # "tiny" | "default"
    truncate: int | None = None
    patches: list[tuple[int, bytes]] = field(default_factory=list)


def _u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def _u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def mutations(source: str, data: bytes, rng: random.Random, *, file_size: int | None = None) -> list[Case]:
    """`data` is the file or, for a big file, its first MBs (the header and tables)."""
    lay = walk(data)
    lay.size = file_size or len(data)
    C: list[Case] = []
    add = lambda name, **kw: C.append(Case(f"{source}:{name}", source, **kw))  # noqa: E731
    # truncation at every structure boundary
    bounds = {0, 4, 8, 16, 24, lay.data_start, lay.size - 1}
    for kv in lay.kvs:
        bounds |= {kv["start"], kv["type_off"], kv["value_off"], kv["end"] - 1}
    for t in lay.tensors:
        bounds |= {t["start"], t["ndims_off"], t["type_off"], t["offset_off"], lay.data_start + t["rel"] + 1}
    for b in sorted(bounds):
        if 0 <= b < lay.size:
            add(f"truncate@{b}", truncate=b)
    # magic and versions
    for magic in (b"GGUG", b"\x00\x00\x00\x00", b"FUGG"):
        add(f"magic={magic!r}", patches=[(0, magic)])
    for v in (0, 1, 4, 0xFFFF, 0xFFFFFFFF):
        add(f"version={v}", patches=[(4, _u32(v))])
    # absurd counts
    n_t = len(lay.tensors)
    n_kv = len(lay.kvs)
    for v in (n_t + 1, 2**31, 2**63, 2**64 - 1):
        add(f"tensor_count={v}", patches=[(lay.n_tensors_off, _u64(v))])
    for v in (n_kv + 1, 2**31, 2**63, 2**64 - 1):
        add(f"kv_count={v}", patches=[(lay.n_kv_off, _u64(v))])
    add("tensor_count=n-1", patches=[(lay.n_tensors_off, _u64(n_t - 1))])
    add("kv_count=0", patches=[(lay.n_kv_off, _u64(0))])
    # string and array lengths past EOF
    for kv in rng.sample(lay.kvs, min(6, len(lay.kvs))):
        add(f"keylen-past-eof:{kv['key']}", patches=[(kv["start"], _u64(lay.size * 4))])
        add(f"keylen=2^63:{kv['key']}", patches=[(kv["start"], _u64(2**63))])
        add(f"type=99:{kv['key']}", patches=[(kv["type_off"], _u32(99))])
        if kv["type"] == 8:
            add(f"strlen-past-eof:{kv['key']}", patches=[(kv["value_off"], _u64(lay.size))])
    for kv in lay.kvs:
        if "count_off" in kv:
            add(f"arraylen-past-eof:{kv['key']}", patches=[(kv["count_off"], _u64(lay.size * 8))])
            add(f"arraylen=2^62:{kv['key']}", patches=[(kv["count_off"], _u64(2**62))])
            add(f"arraytype=77:{kv['key']}", patches=[(kv["count_off"] - 4, _u32(77))])
            if "first_str_off" in kv:
                add(f"array-strlen-past-eof:{kv['key']}", patches=[(kv["first_str_off"], _u64(2**40))])
    # tensor table
    for t in rng.sample(lay.tensors, min(8, len(lay.tensors))):
        nm = t["name"]
        add(f"namelen-past-eof:{nm}", patches=[(t["start"], _u64(2**50))])
        add(f"ndims=0:{nm}", patches=[(t["ndims_off"], _u32(0))])
        add(f"ndims=5:{nm}", patches=[(t["ndims_off"], _u32(5))])
        add(f"ndims=2^31:{nm}", patches=[(t["ndims_off"], _u32(2**31))])
        add(f"dim0=0:{nm}", patches=[(t["dims_off"], _u64(0))])
        add(f"dim0=2^40:{nm}", patches=[(t["dims_off"], _u64(2**40))])
        add(f"dim0=2^63:{nm}", patches=[(t["dims_off"], _u64(2**63))])
        add(f"dim0+32:{nm}", patches=[(t["dims_off"], _u64(struct.unpack_from("<Q", data, t["dims_off"])[0] + 32))])
        add(f"dim0=7:{nm}", patches=[(t["dims_off"], _u64(7))])
        add(f"type=99:{nm}", patches=[(t["type_off"], _u32(99))])
        add(f"type=2^31:{nm}", patches=[(t["type_off"], _u32(2**31))])
        add(f"offset-past-eof:{nm}", patches=[(t["offset_off"], _u64(lay.size))])
        add(f"offset=2^63:{nm}", patches=[(t["offset_off"], _u64(2**63))])
        add(f"offset-misaligned:{nm}", patches=[(t["offset_off"], _u64(t["rel"] + 1))])
        if t["ndims"] >= 2:
            add(f"dim1+1:{nm}", patches=[(t["dims_off"] + 8, _u64(struct.unpack_from("<Q", data, t["dims_off"] + 8)[0] + 1))])
    # a tensor renamed to a duplicate of another
    if len(lay.tensors) > 2:
        a, b = lay.tensors[1], lay.tensors[2]
        na, nb = a["name"].encode(), b["name"].encode()
        if len(na) == len(nb):
            add("duplicate-tensor-name", patches=[(b["start"] + 8, na)])
    # metadata contradicting the tensors
    arch_kvs = {kv["key"]: kv for kv in lay.kvs}
    for key, values in (
        ("llama.block_count", (0, 1, 999, 2**31)),
        ("llama.embedding_length", (0, 128, 577, 2**31)),
        ("llama.attention.head_count", (0, 7, 2**20)),
        ("llama.attention.head_count_kv", (0, 5, 2**20)),
        ("llama.feed_forward_length", (0, 3)),
        ("llama.vocab_size", (0, 10, 2**31)),
        ("llama.context_length", (0, 2**31)),
        ("general.alignment", (0, 3, 48)),
    ):
        kv = arch_kvs.get(key)
        if kv and kv["type"] == 4:
            for v in values:
                add(f"{key}={v}", patches=[(kv["value_off"], _u32(v))])
    # NaN / Inf weights (float tensors and quantized block scales)
    for t in lay.tensors:
        if t["type"] in (0, 1) and t["ndims"] >= 1:  # F32, F16
            off = lay.data_start + t["rel"]
            nan = b"\x00\x00\xc0\x7f" if t["type"] == 0 else b"\x00\x7e"
            inf = b"\x00\x00\x80\x7f" if t["type"] == 0 else b"\x00\x7c"
            add(f"nan:{t['name']}", patches=[(off + 4 * 3 if t["type"] == 0 else off + 6, nan)])
            add(f"inf:{t['name']}", patches=[(off, inf)])
            if len([c for c in C if c.name.startswith(f"{source}:nan")]) >= 4:
                break
    for t in lay.tensors:
        if t["type"] in (2, 3, 8):  # Q4_0, Q4_1, Q8_0: the f16 scale opens each block
            add(f"nan-scale:{t['name']}", patches=[(lay.data_start + t["rel"], b"\x00\x7e")])
            if len([c for c in C if c.name.startswith(f"{source}:nan-scale")]) >= 3:
                break
    return C


def materialize(case: Case, sources: dict[str, Path], dest: Path) -> Path:
    src = sources[case.source]
    if case.truncate is not None:
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            fo.write(fi.read(case.truncate))
    else:
        shutil.copyfile(src, dest)
    with open(dest, "r+b") as fh:
        for off, b in case.patches:
            fh.seek(off)
            fh.write(b)
    return dest


# -- running ----------------------------------------------------------------

WORKER = r"""
import json, os, sys, tempfile
sys.argv = ['edgellm']
from click.testing import CliRunner
from edgellm.cli import cli
jobs = json.loads(sys.stdin.readline())
for job in jobs:
    print('BEGIN ' + json.dumps(job['key']), flush=True)
    r = CliRunner().invoke(cli, job['args'], catch_exceptions=True)
    exc = r.exception if r.exception and not isinstance(r.exception, SystemExit) else None
    print('END ' + json.dumps({'key': job['key'], 'code': r.exit_code, 'stdout': r.stdout[-400:], 'stderr': r.stderr[-400:], 'exc': repr(exc) if exc else None}), flush=True)
"""


def verdict(code: int, stdout: str, stderr: str, exc) -> str | None:
    """None when the run ended as promised: one `error:` line, exit != 0."""
    if exc:
        return f"uncaught {exc}"
    if code == 0:
        return "accepted a malformed file (exit 0)"
    if "Traceback" in stdout + stderr:
        return "traceback"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if not lines or not lines[-1].startswith("error: "):
        return f"no one-line error (stderr: {stderr.strip()[-120:]!r})"
    return None


def _how_it_ended(rc: int, exit_word: str) -> str:
    return f"signal {-rc}" if rc < 0 else f"{exit_word} {rc}"


def _pump(stream, lines) -> None:
    for ln in stream:
        lines.put(ln)
    lines.put(None)


def run_jobs(jobs: list[dict], env: dict, *, timeout: float) -> list[dict]:
    """Run every job; a job that kills its worker or runs past `timeout` is a problem."""
    import queue
    import threading

    results: list[dict] = []
    pending = list(jobs)
    idle_starts = 0  # workers in a row that ended before they began a job
    while pending:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        proc.stdin.write(json.dumps(pending) + "\n")
        proc.stdin.close()
        # A reader thread, so a run that hangs (no line ever comes) is still timed. It gets its pipe and
        # its queue as arguments: a closure read `lines` when it ran, so a killed worker's end (None)
        # could land in the next worker's queue and end that one's jobs unrun (a CI flake).
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current = None
        done_keys = set()
        hung = False
        deadline = time.monotonic() + timeout + 30  # the first job also pays the worker's start
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                hung = True
                proc.kill()
                break
            if line is None:
                break
            idle_starts = 0
            if line.startswith("BEGIN "):
                current = json.loads(line[6:])
                deadline = time.monotonic() + timeout
            elif line.startswith("END "):
                d = json.loads(line[4:])
                d["problem"] = verdict(d["code"], d["stdout"], d["stderr"], d["exc"])
                results.append(d)
                done_keys.add(tuple(d["key"]))
                current = None
        rc = proc.wait()
        pending = [j for j in pending if tuple(j["key"]) not in done_keys]
        if current is not None:
            if hung:
                why = f"hung (no result within {timeout:g} s)"
            else:
                why = f"killed the process ({_how_it_ended(rc, 'worker exit')})"
            results.append({"key": current, "code": rc, "stdout": "", "stderr": "", "exc": None, "problem": why})
            pending = [j for j in pending if j["key"] != current]
        elif pending:
            # The worker ended before it began a job (CI saw one on a loaded machine). Jobs are never
            # dropped unreported: start another, and after three such starts in a row charge the next job.
            idle_starts += 1
            if idle_starts >= 3:
                job = pending.pop(0)
                why = f"the worker ended before the job began ({_how_it_ended(rc, 'exit')})"
                results.append({"key": job["key"], "code": rc, "stdout": "", "stderr": "", "exc": None, "problem": why})
                idle_starts = 0
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=500, help="number of malformed files (default 500)")
    ap.add_argument("--commands", default="inspect,import,quantize,ppl,chat")
    ap.add_argument("--default-model", type=Path, default=None, help="path to the default GGUF (default: from the store)")
    ap.add_argument("--default-cases", type=int, default=40, help="how many cases use the 98 MB default model")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run before it counts as a hang")
    args = ap.parse_args(argv)

    from support.gguf_files import write_tiny_llama

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="edgellm-fuzz-"))
    try:
        sources = {
            "tiny": write_tiny_llama(work / "tiny.gguf", n_layer=2),
            # a second shape: F32, three layers, grouped-query attention, a chat template
            "tiny32": write_tiny_llama(
                work / "tiny32.gguf",
                n_layer=3,
                n_head_kv=2,
                dtype="f32",
                seed=1,
                chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
            ),
        }
        default = args.default_model
        if default is None:
            try:
                from edgellm.models.resolve import resolve

                default = resolve("smollm2-135m-instruct").path
            except Exception:
                default = None
        cases: list[Case] = []
        if default is not None and Path(default).is_file():
            sources["default"] = Path(default)
            with open(default, "rb") as fh:
                head = fh.read(4 << 20)  # the header and tables are in the first 2 MB
            dcases = mutations("default", head, rng, file_size=Path(default).stat().st_size)
            rng.shuffle(dcases)
            cases += dcases[: args.default_cases]
        tiny_cases = mutations("tiny", sources["tiny"].read_bytes(), rng) + mutations(
            "tiny32", sources["tiny32"].read_bytes(), rng
        )
        rng.shuffle(tiny_cases)
        cases += tiny_cases[: max(0, args.count - len(cases))]
        cases = cases[: args.count]

        text = work / "text.txt"
        text.write_text(("The quick brown fox jumps over the lazy dog. " * 200), encoding="utf-8")
        files_dir = work / "files"
        files_dir.mkdir()
        commands = [c for c in args.commands.split(",") if c]
        env = dict(os.environ, EDGELLM_HOME=str(work / "home"), EDGELLM_OFFLINE="1", HF_HUB_OFFLINE="1")
        jobs = []
        for i, case in enumerate(cases):
            f = materialize(case, sources, files_dir / f"case-{i}.gguf")
            for cmd in commands:
                a = [x.format(f=f, i=i, tmp=work, text=text) for x in COMMANDS[cmd]]
                jobs.append({"key": [i, cmd], "args": a})
        t0 = time.monotonic()
        results = run_jobs(jobs, env, timeout=args.timeout)
        elapsed = time.monotonic() - t0
        problems = [r for r in results if r["problem"]]
        signals = [r for r in problems if "killed the process" in r["problem"]]
        hangs = [r for r in problems if r["problem"].startswith("hung")]
        summary = {
            "files": len(cases),
            "from_default_model": sum(c.source == "default" for c in cases),
            "commands": commands,
            "runs": len(results),
            "failures": len(problems),
            "signals": len(signals),
            "hangs": len(hangs),
            "seconds": round(elapsed, 1),
            "problems": [
                {"case": cases[r["key"][0]].name, "command": r["key"][1], "problem": r["problem"], "stderr": r["stderr"][-200:]}
                for r in problems[:50]
            ],
        }
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(
                f"{summary['files']} malformed files ({summary['from_default_model']} from the default model) x {len(commands)} commands = {summary['runs']} runs in {elapsed:.0f} s"
            )
            print(f"failures: {summary['failures']} (signals: {summary['signals']}, hangs: {summary['hangs']})")
            for p in summary["problems"]:
                print(f"  {p['case']} / {p['command']}: {p['problem']}")
        return 0 if not problems and len(results) == len(jobs) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
