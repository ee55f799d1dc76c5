"""The portable build (`scripts/setup.sh --portable`): every x86-64 CPU variant of
llama.cpp's CPU backend in one wheel, the variant chosen at run time by
edgellm.engine.backends.

It lives in its own venv (.venv-portable) so .venv keeps the host-flags wheel
the rest of the suite runs on; these tests run the CLI from it in child
processes, each with its own EDGELLM_CACHE so a choice remembered by one test
(or by the machine) never answers for another.

The crash test uses EDGELLM_BACKEND_BREAK=<variant>: that variant raises
SIGILL in whichever process loads it, which is what a variant built for
AVX-512 or AMX the OS does not enable does on its first matmul. A test below
proves the switch kills a process that loads it, so the survivals are the
fallback's doing.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest
from support.helpers import ROOT, CliResult

from edgellm.engine import backends, cpu_features

PORTABLE_VENV = Path(os.environ.get("EDGELLM_PORTABLE_VENV", ROOT / ".venv-portable"))
GREEDY = ["--temperature", "0", "--top-k", "1", "--seed", "1", "--no-history", "--ctx", "512"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the CPU variants are x86-64 ones"),
]


@pytest.fixture(scope="session")
def portable_python() -> Path:
    """The portable venv's python: setup.sh reuses the cached wheel (seconds), or builds it (~12 min on 2 cores)."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "setup.sh"), "--portable", "--venv", str(PORTABLE_VENV)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, f"building the portable variant failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return PORTABLE_VENV / "bin" / "python"


def pcli(py: Path, cache: Path, *args, env: dict | None = None, timeout: float = 600) -> CliResult:
    full = {k: v for k, v in os.environ.items() if k not in (backends.FORCE_ENV, backends.BREAK_ENV, "GGML_BACKEND_PATH")}
    full.update({"EDGELLM_CACHE": str(cache), **(env or {})})
    proc = subprocess.run(
        [str(py), "-m", "edgellm.cli", *map(str, args)], env=full, capture_output=True, text=True, timeout=timeout
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def best_enabled_variant(present: list[str]) -> str:
    """The widest x86 level whose every feature the kernel lists: worked out from /proc/cpuinfo alone."""
    flags = backends.cpu_flags()
    ok = [
        n
        for n in present
        if n in backends.VARIANT_FEATURES and all(cpu_features.BY_GGML[f].linux in flags for f in backends.VARIANT_FEATURES[n])
    ]
    return max(ok, key=lambda n: len(backends.VARIANT_FEATURES[n]))


def _variants(doc: dict) -> dict[str, dict]:
    return {v["name"]: v for v in doc["cpu_backend"]["variants"]}


def test_the_host_flags_build_has_no_variants_and_behaves_as_before():
    """.venv's wheel links one CPU backend: nothing to choose, doctor reports no cpu_backend."""
    assert backends.variants() == {} and backends.choose() is None and backends.ensure() is None


def test_chosen_variant_is_the_cpus_best_enabled_level(portable_python, default_gguf, tmp_path):
    res = pcli(portable_python, tmp_path / "cache", "doctor", "--json", "--model", default_gguf)
    assert res.exit_code == 0, res
    doc = res.json()
    rows = _variants(doc)
    assert len(rows) >= 10 and {"x64", "sse42", "haswell", "skylakex", "zen4"} <= set(rows)  # 14 on llama.cpp's x86 list
    best = best_enabled_variant(list(rows))
    cb = doc["cpu_backend"]
    # A variant the kernel's flags allow can still die in the self-test (Sapphire Rapids guests whose hypervisor
    # does not enable AMX state: SIGILL at the first tile load); the choice then falls to the next best, and
    # only then: the variants between the best and the chosen one all crashed, and the reason names them.
    want = cb["variant"]
    crashed = [n for n, v in rows.items() if v["status"] == "crashed"]
    assert want == best or best in crashed, (best, cb)
    for name in crashed:
        assert f"{name} crashed (SIG" in cb["reason"], (name, rows[name], cb)
    assert cb["verified"] and cb["source"] == "self-test", cb
    assert rows[want]["status"] == "chosen" and rows[want]["score"] > 0
    # every variant scored higher than the chosen one needs something the CPU or the OS lacks, or crashed
    for v in rows.values():
        if v["score"] and v["score"] > rows[want]["score"]:
            assert v["status"] in ("unsupported", "not enabled by the OS", "crashed"), v
    # The loaded variant uses nothing the CPU lacks, and what it leaves out no variant that could run here adds:
    # llama.cpp's set has no AVX-512 level with AVX-VNNI (Sapphire Rapids lists both), and a variant that
    # crashed in the self-test adds nothing usable.
    assert doc["unsupported_in_build"] == [], doc
    mine = set(backends.VARIANT_FEATURES[want])
    runnable = [n for n, v in rows.items() if v["status"] in ("chosen", "passed", "not tried") and n in backends.VARIANT_FEATURES]
    wider = [set(backends.VARIANT_FEATURES[n]) for n in runnable if set(backends.VARIANT_FEATURES[n]) > mine]
    for feat in doc["missing_in_build"]:
        assert not any(feat in fs for fs in wider), (feat, want, doc["missing_in_build"])
    assert doc["self_test"]["ok"] and doc["self_test"]["tokens"] == 8
    assert doc["rpc"]["compiled_in"], doc["rpc"]  # the RPC backend is a loadable module too, loaded beside the CPU
    # remembered: the next run neither scores nor self-tests the variants again
    memo = list((tmp_path / "cache" / "cpu-backend").glob("*.json"))
    assert len(memo) == 1 and json.loads(memo[0].read_text())["variant"] == want
    again = pcli(portable_python, tmp_path / "cache", "doctor", "--model", default_gguf)
    assert again.exit_code == 0, again
    assert f"cpu backend       {want} (remembered)" in again.stdout, again.stdout


def test_the_device_registry_sees_the_loaded_variant(portable_python, tmp_path):
    """The GPU plan and doctor ask ggml's registry; before the backends are loaded, or through a second
    copy of libggml, it is empty and every device query says "none"."""
    code = (
        "from edgellm.engine import gpu; lib = gpu._ggml(); "
        "print(lib.ggml_backend_dev_count(), [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode() "
        "for i in range(lib.ggml_backend_reg_count())])"
    )
    env = {k: v for k, v in os.environ.items() if k not in (backends.FORCE_ENV, backends.BREAK_ENV, "GGML_BACKEND_PATH")}
    proc = subprocess.run(
        [str(portable_python), "-c", code],
        env={**env, "EDGELLM_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    n_dev, regs = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(n_dev) >= 1 and "CPU" in regs and "RPC" in regs, proc.stdout


def test_the_break_switch_kills_a_process_that_loads_the_variant(portable_python, default_gguf, tmp_path):
    """The switch is a real crash: forced onto the broken variant, chat dies with SIGILL."""
    want = best_enabled_variant(list(backends.VARIANT_FEATURES))
    res = pcli(
        portable_python,
        tmp_path / "cache",
        "chat",
        default_gguf,
        "-p",
        "Hi",
        "--max-tokens",
        "2",
        *GREEDY,
        env={backends.BREAK_ENV: want, backends.FORCE_ENV: want},
    )
    assert res.exit_code == -4, res  # -SIGILL


def test_a_crashing_variant_is_skipped_by_doctor_and_chat(portable_python, default_gguf, tmp_path):
    best = best_enabled_variant(list(backends.VARIANT_FEATURES))
    broken = {backends.BREAK_ENV: best}
    # chat on a machine with nothing remembered: it self-tests, skips the crashing variant, answers
    chat = pcli(
        portable_python,
        tmp_path / "chat-cache",
        "chat",
        default_gguf,
        "-p",
        "Name three colours.",
        "--max-tokens",
        "8",
        "--json",
        *GREEDY,
        env=broken,
    )
    assert chat.exit_code == 0, chat
    assert chat.json()["stats"]["generated_tokens"] == 8 and chat.json()["reply"].strip()
    # doctor says which variant runs and why, the crashed one with its signal
    res = pcli(portable_python, tmp_path / "doctor-cache", "doctor", "--json", "--model", default_gguf, env=broken)
    assert res.exit_code == 0, res
    doc = res.json()
    rows = _variants(doc)
    cb = doc["cpu_backend"]
    assert cb["variant"] != best and cb["verified"], cb
    assert rows[best]["status"] == "crashed" and "SIGILL" in rows[best]["reason"], rows[best]
    assert f"skipped {best} crashed (SIGILL)" in cb["reason"], cb["reason"]
    # the fallback is the next-best-scored variant the CPU supports
    passed = sorted(
        (v for v in rows.values() if v["score"] and v["name"] != best and v["status"] in ("chosen", "not tried")),
        key=lambda v: -v["score"],
    )
    assert passed[0]["name"] == cb["variant"]
    assert doc["self_test"]["ok"], doc["self_test"]
    text = pcli(portable_python, tmp_path / "doctor-cache", "doctor", "--model", default_gguf, env=broken)
    assert text.exit_code == 0, text
    assert (
        f"cpu backend       {cb['variant']} (remembered): best variant that passed the self-test; skipped {best} crashed (SIGILL)"
        in text.stdout
    ), text.stdout
    # and a later chat, with the choice remembered, answers without any self-test
    again = pcli(
        portable_python,
        tmp_path / "doctor-cache",
        "chat",
        default_gguf,
        "-p",
        "Hi",
        "--max-tokens",
        "4",
        "--json",
        *GREEDY,
        env=broken,
    )
    assert again.exit_code == 0 and again.json()["stats"]["generated_tokens"] == 4, again
