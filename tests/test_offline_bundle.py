"""The offline install bundle (scripts/offline_bundle.sh) and its install.sh.

Proven here: a bundle built with the real default model installs into a fresh
venv inside a network namespace that has no network at all (`unshare -n`, as
root): pip reads only the bundle's wheels, the doctor self-test passes, and
`edgellm chat` answers from the bundled model. A bundle with one changed byte,
a missing wheel, or made for another Python version is refused with one line
before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from edgellm.engine import backends
from support.helpers import DEFAULT_NAME, ROOT, register_default
from support.helpers import DEFAULT_SHA256 as DEFAULT_SHA
from support.helpers import shared_cache

# The interpreter behind .venv: a plain Python, as a target machine has.
BASE_PYTHON = os.path.realpath(sys.executable)
PY_VERSION = "%d.%d" % sys.version_info[:2]


def _no_network_namespace() -> None:
    proc = subprocess.run(["unshare", "-n", "cat", "/proc/net/dev"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"`unshare -n` is not available here (needs root): {proc.stderr.strip()}")
    ifaces = [ln.split(":")[0].strip() for ln in proc.stdout.splitlines()[2:]]
    assert ifaces == ["lo"], ifaces  # the namespace has a loopback and nothing else


def target_env(tmp: Path) -> dict[str, str]:
    """What a fresh target machine has: no PIP_* settings, no edgellm, its own HOME."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp / "home"),
        "EDGELLM_HOME": str(tmp / "home" / "edgellm"),
        "PYTHON": BASE_PYTHON,
        "LANG": "C.UTF-8",
    }


def run_install(bundle: Path, tmp: Path, *, namespace: bool = True, cpuinfo: Path | None = None) -> subprocess.CompletedProcess:
    """install.sh as a target runs it; `cpuinfo`: that CPU's recorded flags instead of this one's."""
    cmd = ["bash", str(bundle / "install.sh"), "--venv", str(tmp / "venv")]
    if namespace:
        cmd = ["unshare", "-n", "--", *cmd]
    (tmp / "home").mkdir(parents=True, exist_ok=True)
    env = target_env(tmp) | ({"EDGELLM_CPUINFO": str(cpuinfo)} if cpuinfo else {})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)


def write_sums(bundle: Path) -> None:
    """SHA256SUMS as offline_bundle.sh writes it (for a bundle rebuilt differently)."""
    lines = []
    for p in sorted(bundle.rglob("*")):
        if p.is_file() and p.name != "SHA256SUMS":
            lines.append(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(bundle).as_posix()}\n")
    (bundle / "SHA256SUMS").write_text("".join(lines))


@pytest.fixture(scope="module")
def bundle(default_gguf, tmp_path_factory) -> Iterator[Path]:
    """A bundle with the default model, built once for this module."""
    home = tmp_path_factory.mktemp("bundle-home")
    register_default(default_gguf, home)
    dest = tmp_path_factory.mktemp("usb") / "edgellm-bundle"
    env = dict(os.environ, EDGELLM_HOME=str(home))
    proc = subprocess.run(
        [str(ROOT / "scripts" / "offline_bundle.sh"), str(dest), "--model", DEFAULT_NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(dest)
    yield dest
    shutil.rmtree(dest.parent, ignore_errors=True)  # its wheels and model: not kept for the rest of the session


def test_the_bundle_holds_every_wheel_the_models_and_their_sums(bundle):
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["python"] == [PY_VERSION] and meta["platform"] == "linux-x86_64" and meta["models"] == [DEFAULT_NAME]
    wheels = {p.name.split("-")[0].lower() for p in (bundle / "wheels").glob("*.whl")}
    assert {"llama_cpp_python", "edgellm", "numpy", "gguf", "huggingface_hub", "textual", "uvicorn", "pip"} <= wheels
    assert (bundle / "wheels" / meta["llama_cpp_python"]["wheel"]).is_file()
    sums = dict(reversed(ln.split("  ", 1)) for ln in (bundle / "SHA256SUMS").read_text().splitlines())
    files = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"SHA256SUMS"}
    assert set(sums) == files
    model = f"models/{DEFAULT_NAME}/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sums[model] == DEFAULT_SHA
    # the model travels as an `edgellm export` bundle, with its own manifest
    assert json.loads((bundle / "models" / "manifest.json").read_text())["models"][0]["sha256"] == DEFAULT_SHA


def test_installs_with_no_network_and_chat_answers(bundle, tmp_path):
    _no_network_namespace()
    proc = run_install(bundle, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"imported {DEFAULT_NAME}: q4_1, 135M parameters, sha256 {DEFAULT_SHA[:12]}..." in out
    assert "self-test         passed: 8 tokens" in out, out
    if json.loads((bundle / "bundle.json").read_text())["llama_cpp_python"]["portable"]:
        # the portable wheel (cached by setup.sh --portable): the target chose a CPU variant and self-tested it
        assert "cpu backend " in out and " (self-test): " in out, out
    venv = tmp_path / "venv"
    assert out.strip().splitlines()[-1].startswith(f"next: {venv}/bin/edgellm chat {DEFAULT_NAME}")
    # the venv runs the bundle's llama.cpp build, not the test suite's
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import llama_cpp, edgellm; print(llama_cpp.__file__, edgellm.__file__)"],
        capture_output=True,
        text=True,
        env=target_env(tmp_path),
        cwd=tmp_path,
    )
    assert where.returncode == 0 and all(p.startswith(str(venv)) for p in where.stdout.split()), where
    chat = subprocess.run(
        [
            "unshare",
            "-n",
            "--",
            str(venv / "bin" / "edgellm"),
            "chat",
            DEFAULT_NAME,
            "-p",
            "What is the capital of France?",
            "--max-tokens",
            "12",
            "--seed",
            "1",
            "--temperature",
            "0",
            "--no-history",
        ],
        env=target_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
    # the reply, then one stats line and nothing else: no llama.cpp log (a portable build once printed
    # llama.cpp's search for backends it keeps elsewhere, 30 lines, before every reply)
    assert "Paris" in chat.stdout, chat
    stats = re.fullmatch(r"\[(\d+) tokens, [^\]]*; stop: (eos|length)\]", chat.stderr.strip())
    assert stats, chat.stderr
    # greedy: the CPU's kernels decide whether the reply ends before the limit (7 tokens on Zen 4, 12 on Sapphire Rapids)
    assert int(stats[1]) == 12 if stats[2] == "length" else int(stats[1]) < 12, chat.stderr
    # a second run is a no-op for the models and still proves the install
    again = run_install(bundle, tmp_path)
    assert again.returncode == 0 and "already in the store" in again.stdout, again.stderr[-2000:]


def _copy(bundle: Path, tmp: Path) -> Path:
    """A copy by hard links: cheap, and every change below replaces a file rather than writing into it."""
    dst = tmp / "bundle"
    subprocess.run(["cp", "-al", str(bundle), str(dst)], check=True)
    return dst


def _refused(proc: subprocess.CompletedProcess, tmp: Path) -> str:
    assert proc.returncode != 0, proc
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("; nothing was installed"), proc.stderr
    assert proc.stdout == ""  # not one step of the install began
    assert not (tmp / "venv").exists() and not (tmp / "home" / "edgellm").exists()
    return lines[0]


@pytest.mark.parametrize("target", ["wheel", "model"])
def test_one_changed_byte_is_refused_before_installing(bundle, tmp_path, target):
    b = _copy(bundle, tmp_path)
    if target == "wheel":
        victim = next((b / "wheels").glob("numpy-*.whl"))
    else:
        victim = b / "models" / DEFAULT_NAME / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.unlink()  # break the hard link: the module's bundle stays intact
    victim.write_bytes(bytes(data))
    rel = victim.relative_to(b).as_posix()
    line = _refused(run_install(b, tmp_path, namespace=False), tmp_path)
    assert line.startswith(f"error: bundle file {rel} was changed or damaged (sha256 ")


def test_a_missing_wheel_is_refused_before_installing(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    victim = next((b / "wheels").glob("jinja2-*.whl"))
    victim.unlink()
    line = _refused(run_install(b, tmp_path, namespace=False), tmp_path)
    assert line == f"error: bundle file wheels/{victim.name} is missing; nothing was installed"


def test_a_bundle_for_another_python_is_refused_before_installing(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    meta = json.loads((b / "bundle.json").read_text())
    other = "3.10" if PY_VERSION != "3.10" else "3.12"
    meta["python"] = [other]
    (b / "bundle.json").unlink()
    (b / "bundle.json").write_text(json.dumps(meta))
    (b / "SHA256SUMS").unlink()
    write_sums(b)  # a consistent bundle, made for another version
    line = _refused(run_install(b, tmp_path, namespace=False), tmp_path)
    assert line.startswith(f"error: this bundle was made for Python {other} and {BASE_PYTHON} is Python {PY_VERSION} ")


def test_the_builder_refuses_a_non_empty_destination(tmp_path):
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "keep.txt").write_text("mine")
    proc = subprocess.run([str(ROOT / "scripts" / "offline_bundle.sh"), str(tmp_path / "dest")], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip() == f"offline_bundle.sh: {tmp_path / 'dest'} exists and is not empty"
    assert (tmp_path / "dest" / "keep.txt").read_text() == "mine"


CPUINFO = Path(__file__).parent / "data" / "cpuinfo"
ZEN4, ZEN2 = CPUINFO / "zen4-epyc-9654.txt", CPUINFO / "zen2-epyc-7742.txt"


@pytest.fixture(scope="module")
def avx512_bundle(default_gguf, tmp_path_factory) -> Iterator[Path]:
    """A bundle made on an AVX-512 EPYC (Zen 4: `avx512vbmi` beside `avx512_vbmi2`), from its recorded
    flags: setup's flag set for that CPU, and this machine's wheel carried under it (what runs here)."""
    home = tmp_path_factory.mktemp("bundle-home-zen4")
    register_default(default_gguf, home)
    dest = tmp_path_factory.mktemp("usb-zen4") / "edgellm-bundle"
    wheel = next((shared_cache() / "wheels").glob("[0-9a-f]*/llama_cpp_python-*.whl"))
    env = dict(os.environ, EDGELLM_HOME=str(home), EDGELLM_CPUINFO=str(ZEN4))
    proc = subprocess.run(
        [str(ROOT / "scripts" / "offline_bundle.sh"), str(dest), "--model", DEFAULT_NAME, "--llama-wheel", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield dest
    shutil.rmtree(dest.parent, ignore_errors=True)


def test_a_bundle_made_on_an_avx512_cpu_names_its_flags_in_both_spellings(avx512_bundle):
    meta = json.loads((avx512_bundle / "bundle.json").read_text())["llama_cpp_python"]
    assert meta["portable"] is False
    assert meta["cpu_features"] == ["AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"]
    assert meta["cpu_flags"] == ["avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"]


def _zen4_with_this_cpus_flags(tmp: Path) -> Path:
    """The recorded Zen 4 line plus this machine's own flags. The wheel under the bundle is this machine's build
    (the fixture's), and the installer's doctor checks it against the CPU it is told of: told of a bare Zen 4
    on a CPU that also has AVX-VNNI (Sapphire Rapids), it rightly says the build uses what that Zen 4 lacks."""
    host = sorted(backends.cpu_flags())  # the kernel's list for this machine, as the product reads it
    lines = ZEN4.read_text().splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("flags"):
            head, flags = ln.split(":", 1)
            lines[i] = f"{head}: {' '.join(dict.fromkeys(flags.split() + host))}"
    out = tmp / "zen4-and-this-cpu.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


def test_a_bundle_made_on_an_avx512_cpu_installs_on_that_cpu(avx512_bundle, tmp_path):
    proc = run_install(avx512_bundle, tmp_path, namespace=False, cpuinfo=_zen4_with_this_cpus_flags(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "self-test         passed: 8 tokens" in proc.stdout, proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(f"next: {tmp_path / 'venv'}/bin/edgellm chat {DEFAULT_NAME}")


def test_a_bundle_made_on_an_avx512_cpu_is_refused_on_an_avx2_cpu_naming_each_missing_flag(avx512_bundle, tmp_path):
    line = _refused(run_install(avx512_bundle, tmp_path, namespace=False, cpuinfo=ZEN2), tmp_path)
    assert line == (
        "error: this bundle's llama.cpp was built for CPUs with AVX512 (avx512f), AVX512_VBMI (avx512vbmi), "
        "AVX512_VNNI (avx512_vnni), AVX512_BF16 (avx512_bf16), which this CPU lacks "
        "(make the bundle from a portable build: scripts/setup.sh --portable); nothing was installed"
    )
