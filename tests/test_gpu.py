"""GPU offload on a real Vulkan device: Mesa's lavapipe (software Vulkan, runs on the CPU).

The Vulkan build lives in its own venv (.venv-vulkan, `scripts/setup.sh --gpu
vulkan --venv`), so the CPU wheel in .venv that every other test uses is never
swapped out; these tests run the CLI from it in child processes. llama.cpp
hides CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them, so
the runs that use lavapipe set it. lavapipe is slow (~1 tok/s for the default
model, ~40 s of pipeline compilation per process), so token counts are tiny
and each Vulkan process does as much as it can.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.helpers import CliResult, run_cli

ROOT = Path(__file__).resolve().parents[1]
VK_VENV = Path(os.environ.get("EDGELLM_VULKAN_VENV", ROOT / ".venv-vulkan"))
VK_HEADERS = ROOT.parent / "shared" / "third_party" / "vulkan-headers"
APT = "apt-get install -y mesa-vulkan-drivers libvulkan-dev glslc spirv-headers"
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}
PROMPT = "Name three colours."
GREEDY = ["--temperature", "0", "--top-k", "1", "--seed", "1", "--no-history", "--ctx", "512"]

pytestmark = pytest.mark.slow


def _missing() -> list[str]:
    miss = [] if shutil.which("glslc") else ["glslc"]
    miss += [] if Path("/usr/include/vulkan/vulkan.h").exists() else ["libvulkan-dev"]
    miss += [] if Path("/usr/include/spirv").is_dir() else ["spirv-headers"]
    icds = [p for d in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d") for p in Path(d).glob("lvp_icd*.json")]
    return miss + ([] if icds else ["mesa-vulkan-drivers (lavapipe)"])


@pytest.fixture(scope="session")
def vk_python() -> Path:
    """The Vulkan venv's python, built (or found cached) by setup.sh."""
    missing = _missing()
    if missing:
        msg = f"the Vulkan tests need {', '.join(missing)}: {APT}"
        if os.environ.get("EDGELLM_CI") or Path("/etc/debian_version").exists():
            pytest.fail(msg)  # CI and Debian can have them: a missing build is a failure there, never a skip
        pytest.skip(msg + " (off CI, not Debian)")
    cmd = [str(ROOT / "scripts" / "setup.sh"), "--gpu", "vulkan", "--venv", str(VK_VENV)]
    if VK_HEADERS.joinpath("include").is_dir():
        cmd += ["--vulkan-headers", str(VK_HEADERS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"building the Vulkan variant failed: {proc.stderr[-2000:]}"
    return VK_VENV / "bin" / "python"


def vk_cli(vk_python: Path, *args, env: dict | None = None, timeout: float = 900) -> CliResult:
    """The CLI from the Vulkan venv; lavapipe stays hidden unless `env` shows it (LAVAPIPE)."""
    full = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    full.update(env or {})
    proc = subprocess.run(
        [str(vk_python), "-m", "edgellm.cli", *map(str, args)], env=full, capture_output=True, text=True, timeout=timeout
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def vk_chat(vk_python: Path, gguf: Path, *flags, tokens: int = 2, greedy=GREEDY, env: dict | None = None) -> CliResult:
    """`chat -p PROMPT --json` from the Vulkan venv, greedy; lavapipe visible unless `env` is given ({}: hidden)."""
    env = LAVAPIPE if env is None else env
    return vk_cli(vk_python, "chat", gguf, "-p", PROMPT, "--max-tokens", tokens, "--json", *greedy, *flags, env=env)


def chat_json(res: CliResult) -> dict:
    assert res.exit_code == 0, res
    assert "Traceback" not in res.stderr, res
    return res.json()


def warnings(res: CliResult) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("warning: ")]


def within(plan_bytes: int, real_bytes: int, tol: float = 0.15) -> bool:
    return real_bytes > 0 and abs(plan_bytes - real_bytes) <= tol * real_bytes


def test_doctor_lists_lavapipe_as_software(vk_python):
    res = vk_cli(vk_python, "doctor", "--json", "--no-self-test", env=LAVAPIPE, timeout=300)
    devs = json.loads(res.stdout)["gpu"]["devices"]
    assert [d["name"] for d in devs] == ["Vulkan0"], res
    d = devs[0]
    assert d["software"] and d["note"] == "software: no speed-up expected" and "llvmpipe" in d["description"]
    assert d["backend"] == "Vulkan" and d["total_bytes"] > 0 and 0 < d["free_bytes"] <= d["total_bytes"]
    text = vk_cli(vk_python, "doctor", "--no-self-test", env=LAVAPIPE, timeout=300)
    assert "Vulkan0" in text.stdout and "software: no speed-up expected" in text.stdout
    # without the variable llama.cpp hides lavapipe; doctor says how to show it
    gpu = json.loads(vk_cli(vk_python, "doctor", "--json", "--no-self-test", timeout=300).stdout)["gpu"]
    assert gpu["devices"] == [] and "GGML_VK_VISIBLE_DEVICES=0" in gpu["note"]


def test_all_layers_on_lavapipe_match_cpu_and_the_plan(vk_python, default_gguf):
    """Every layer on the device (--gpu-layers 99, clamped with a note): the same 8 greedy tokens as the CPU,
    llama.cpp reports all 31 offloaded, and the plan's device bytes are within 15% of its allocations."""
    # flash attention is on by default only with every layer on the CPU (memory.flash_attn_default), off with
    # GPU layers; its kernel rounds differently, so the CPU reference runs with the attention the device runs with
    cpu = chat_json(run_cli("chat", default_gguf, "-p", PROMPT, "--max-tokens", "8", "--json", *GREEDY, "--flash-attn", "off"))
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "99", "--gpu-device", "0", tokens=8)
    gpu = chat_json(res)
    assert cpu["stats"]["generated_tokens"] == gpu["stats"]["generated_tokens"] == 8
    assert gpu["reply"] == cpu["reply"], (cpu["reply"], gpu["reply"])
    assert any("--gpu-layers 99 is more than the model's 31 layers" in w for w in warnings(res)), res.stderr
    assert "GPU offload: 31/31 layers on Vulkan0" in res.stderr  # printed before loading
    rep = gpu["gpu"]
    assert rep["n_gpu_layers"] == 31 and rep["plan"]["n_gpu_layers"] == 31
    assert rep["allocated"]["offloaded_layers"] == 31 and rep["allocated"]["max_layers"] == 31
    assert within(rep["plan"]["device_bytes"], rep["allocated"]["device_bytes"]), rep
    assert cpu["gpu"]["allocated"]["device_bytes"] == 0


def test_auto_offloads_what_fits_in_gpu_mem(vk_python, default_gguf, tmp_path):
    """--gpu-mem holding the compute buffer and about half the layers: auto picks a partial set, and its
    device bytes are within 15% of what llama.cpp allocated on the device; the reply still comes.
    (At ctx 512 the compute buffer, mostly the logits of a 512-token batch, is half of the device's share.)"""
    full, one = _plan(vk_python, default_gguf, "all"), _plan(vk_python, default_gguf, "1")
    half = (full["device_bytes"] + one["device_bytes"]) // 2
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "auto", "--gpu-device", "Vulkan0", "--gpu-mem", str(half))
    rep = chat_json(res)["gpu"]
    n = rep["n_gpu_layers"]
    assert 0 < n < 31, rep
    assert rep["plan"]["device_bytes"] <= half < _plan(vk_python, default_gguf, str(n + 1), half)["device_bytes"]
    assert rep["allocated"]["offloaded_layers"] == n
    assert within(rep["plan"]["device_bytes"], rep["allocated"]["device_bytes"]), rep
    assert rep["allocated"]["host_bytes"] > 0 and chat_json(res)["stats"]["generated_tokens"] == 2


def _plan(vk_python: Path, gguf: Path, layers: str, gpu_mem: int | None = None) -> dict:
    """The plan alone (no load), from the Vulkan venv with lavapipe visible."""
    code = (
        "import json, sys; from edgellm.engine.gpu import plan_offload; from edgellm.gguf.reader import read_gguf;"
        "p = sys.argv[1]; m = int(sys.argv[3]) if sys.argv[3] != 'None' else None;"
        "print(json.dumps(plan_offload(p, read_gguf(p), sys.argv[2], ctx=512, gpu_device='0', gpu_mem=m).to_json()))"
    )
    proc = subprocess.run(
        [str(vk_python), "-c", code, str(gguf), layers, str(gpu_mem)],
        capture_output=True,
        text=True,
        env=dict(os.environ, **LAVAPIPE),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_auto_below_one_layer_chooses_cpu_and_says_why(vk_python, default_gguf):
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "auto", "--gpu-device", "0", "--gpu-mem", "1M")
    rep = chat_json(res)["gpu"]
    assert rep["n_gpu_layers"] == 0 and rep["allocated"]["device_bytes"] == 0
    assert "one layer needs" in rep["plan"]["reason"] and "(--gpu-mem)" in rep["plan"]["reason"]
    assert "GPU offload: none (one layer needs" in res.stderr


def test_auto_never_picks_a_software_device(vk_python, default_gguf):
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "auto")
    rep = chat_json(res)["gpu"]
    assert rep["n_gpu_layers"] == 0 and rep["allocated"]["device_bytes"] == 0
    assert "software: no speed-up expected" in rep["plan"]["reason"] and "--gpu-device" in rep["plan"]["reason"]
    assert warnings(res) == []  # auto chose the CPU: a plan line, not a warning


def test_bench_all_layers_reports_the_device_split(vk_python, default_gguf):
    res = vk_cli(
        vk_python,
        "bench",
        default_gguf,
        "--pp",
        "8",
        "--tg",
        "2",
        "-r",
        "1",
        "--ctx",
        "64",
        "--json",
        "--no-progress",
        "--gpu-layers",
        "all",
        "--gpu-device",
        "0",
        env=LAVAPIPE,
    )
    assert res.exit_code == 0, res
    rows = res.json()
    assert [r["test"] for r in rows] == ["pp8", "tg2"]
    for r in rows:
        assert r["n_gpu_layers"] == 31 and "llvmpipe" in r["gpu_device"], r
        assert r["device_bytes"] > 0.8 * r["model_size"] and r["host_bytes"] > 0 and r["avg_ts"] > 0


# -- failure paths: one warning line, then the CPU ------------------------------------------


def _cpu_fallback(res: CliResult, expect: str) -> dict:
    out = chat_json(res)
    w = warnings(res)
    assert len(w) == 1 and expect in w[0], res.stderr
    assert w[0].endswith(("running on the CPU", "loading on the CPU")), res.stderr
    assert out["gpu"]["n_gpu_layers"] == 0 and out["gpu"]["allocated"]["device_bytes"] == 0
    assert out["stats"]["generated_tokens"] == 2
    return out


def test_no_device_warns_and_runs_on_cpu(vk_python, default_gguf):
    # the Vulkan build with lavapipe hidden: no device at all
    _cpu_fallback(
        vk_chat(vk_python, default_gguf, "--gpu-layers", "8", env={}),
        "no GPU device",
    )
    # the CPU-only wheel: same path
    _cpu_fallback(
        run_cli("chat", default_gguf, "-p", PROMPT, "--max-tokens", "2", "--json", *GREEDY, "--gpu-layers", "8"), "CPU-only"
    )


def test_device_that_fails_to_allocate_falls_back_to_cpu(vk_python, default_gguf):
    # A device whose buffers may hold at most 4 KiB: llama.cpp cannot place a single weight on it.
    small = {**LAVAPIPE, "GGML_VK_FORCE_MAX_BUFFER_SIZE": "4096"}
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "all", "--gpu-device", "0", env=small)
    out = _cpu_fallback(res, "GPU offload to Vulkan0")
    assert "fallback" in out["gpu"]["plan"]["reason"]


def test_device_lost_during_load_falls_back_to_cpu(vk_python, default_gguf):
    # Device buffers of at most 80 MiB: the weights of 11 layers (52 MB) go onto the device, then the
    # context's KV cache for them (10 blocks x 12 MiB at ctx 16384, one 120 MiB buffer) is refused:
    # the load dies halfway, with the model already on the device, as when a device is lost mid-load.
    args = [a if a != "512" else "16384" for a in GREEDY]
    small = {**LAVAPIPE, "GGML_VK_FORCE_MAX_BUFFER_SIZE": str(80 << 20)}
    res = vk_chat(vk_python, default_gguf, "--gpu-layers", "11", "--gpu-device", "0", greedy=args, env=small)
    out = _cpu_fallback(res, "GPU offload to Vulkan0")
    w = warnings(res)[0]
    assert f"buffer of size {10 * 2 * 192 * 16384 * 2}" in w and "after the weights were placed on Vulkan0" in w, w
    assert out["reply"]
