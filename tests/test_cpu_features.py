"""The one CPU-feature table (edgellm/engine/cpu_features.tsv) over recorded flag lines of real CPUs.

Every reader is run on the same recorded /proc/cpuinfo heads (tests/data/cpuinfo), never on
this machine's: the cmake arguments scripts/_cpu_flags.sh gives setup.sh, the features
`edgellm doctor` reports, the portable variant the kernel allows, and what a bundle made on
that CPU needs and its installer checks.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.helpers import ROOT

from edgellm.engine import backends, cpu_features, hardware

DATA = Path(__file__).parent / "data" / "cpuinfo"

# ggml's names of what each CPU's kernel lists, in the table's order
_AVX2 = ["SSE3", "SSSE3", "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"]
_SKX = _AVX2 + ["AVX512"]
EXPECTED: dict[str, tuple[list[str], str]] = {  # file -> (features, best portable variant)
    "zen2-epyc-7742": (_AVX2, "haswell"),
    "zen3-epyc-7763": (_AVX2, "haswell"),
    "zen4-epyc-9654": (_SKX + ["AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"], "zen4"),
    "skylakex-xeon-gold-6148": (_SKX, "skylakex"),
    "icelake-xeon-platinum-8380": (_SKX + ["AVX512_VBMI", "AVX512_VNNI"], "icelake"),
    "sapphirerapids-xeon-platinum-8480": (
        _AVX2 + ["AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16"],
        "sapphirerapids",
    ),
    "alderlake-core-i7-12700k": (_AVX2 + ["AVX_VNNI"], "alderlake"),
    "sse42-xeon-x5570": (["SSE3", "SSSE3", "SSE42"], "sse42"),
    "arm64-graviton2-neoverse-n1": (["NEON", "ARM_FMA", "DOTPROD", "FP16_VA"], ""),
    "arm64-graviton3-neoverse-v1": (["NEON", "ARM_FMA", "DOTPROD", "FP16_VA", "MATMUL_INT8", "SVE"], ""),
}
X86 = [n for n in EXPECTED if not n.startswith("arm64")]


def recorded(name: str) -> cpu_features.HostFlags:
    path = DATA / f"{name}.txt"
    arch, flags = cpu_features.parse_cpuinfo(path.read_text())
    return cpu_features.HostFlags("linux", frozenset(flags), str(path), arch)


def shell_cmake_args(name: str) -> str:
    """scripts/_cpu_flags.sh's arguments for the CPU of a recorded dump (what setup.sh would build)."""
    proc = subprocess.run(
        ["bash", "-c", "source scripts/_cpu_flags.sh && edgellm_cpu_build_args"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "EDGELLM_CPUINFO": str(DATA / f"{name}.txt")},
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


def test_every_recorded_cpu_is_here():
    assert sorted(p.stem for p in DATA.glob("*.txt")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_doctor_reads_each_recorded_cpu(name, monkeypatch):
    monkeypatch.setenv(cpu_features.CPUINFO_ENV, str(DATA / f"{name}.txt"))
    assert hardware.cpu_features() == EXPECTED[name][0]
    assert recorded(name).arch == ("arm64" if name.startswith("arm64") else "x86")


@pytest.mark.parametrize("name", X86)
def test_setup_builds_exactly_what_the_kernel_lists_never_amx(name):
    args = shell_cmake_args(name)
    on = cpu_features.needs_of_cmake_args(args)
    feats = EXPECTED[name][0]
    assert on == [f for f in feats if cpu_features.BY_GGML[f].build == "host"]
    assert "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" in args
    # and a bundle made there needs only what that same kernel lists, in its own spelling
    assert cpu_features.missing(on, recorded(name)) == []


def test_the_avx2_build_arguments_and_so_the_wheel_cache_key_are_unchanged():
    """The table's row order is the -D order: a reorder would rebuild every cached wheel."""
    assert shell_cmake_args("zen2-epyc-7742") == (
        "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF "
        "-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
        "-DGGML_AMX_BF16=OFF"
    )


def test_avx512_vbmi_is_read_in_the_kernels_spelling():
    """The bug: cmake's AVX512_VBMI lower-cased is `avx512_vbmi`; Linux says `avx512vbmi` beside `avx512_vbmi2`."""
    zen4 = recorded("zen4-epyc-9654")
    assert "avx512vbmi" in zen4.flags and "avx512_vbmi2" in zen4.flags and "avx512_vbmi" not in zen4.flags
    assert "-DGGML_AVX512_VBMI=ON" in shell_cmake_args("zen4-epyc-9654")
    assert cpu_features.BY_GGML["AVX512_VBMI"].linux == "avx512vbmi"


@pytest.mark.parametrize("name", X86)
def test_the_portable_choice_allows_the_widest_level_the_kernel_lists(name):
    flags = set(recorded(name).flags)
    allowed = [v for v in backends.VARIANT_FEATURES if not backends.os_missing(v, flags)]
    assert max(allowed, key=lambda v: len(backends.VARIANT_FEATURES[v])) == EXPECTED[name][1]


def test_the_portable_choice_names_what_the_kernel_lacks_in_its_spelling():
    zen3 = set(recorded("zen3-epyc-7763").flags)
    assert backends.os_missing("zen4", zen3) == ["avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"]
    assert backends.os_missing("sapphirerapids", set(recorded("zen4-epyc-9654").flags)) == ["amx_tile", "amx_int8"]


def test_zen2s_sme_is_not_arms_sme():
    """Zen 2 lists `sme` (Secure Memory Encryption): an x86 dump is read against the x86 rows only."""
    assert "sme" in recorded("zen2-epyc-7742").flags
    assert "SME" not in cpu_features.present(recorded("zen2-epyc-7742"))


def test_an_avx512_bundle_is_refused_on_an_avx2_cpu_naming_each_missing_flag():
    needs = cpu_features.needs_of_cmake_args(shell_cmake_args("zen4-epyc-9654"))
    lack = cpu_features.missing(needs, recorded("zen2-epyc-7742"))
    assert (
        ", ".join(f.label() for f in lack)
        == "AVX512 (avx512f), AVX512_VBMI (avx512vbmi), AVX512_VNNI (avx512_vnni), AVX512_BF16 (avx512_bf16)"
    )


def test_the_check_runs_by_path_as_the_installer_runs_it():
    """The installer has no edgellm yet: the module and its table run alone, standard library only."""
    script = ROOT / "edgellm" / "engine" / "cpu_features.py"
    env = {"PATH": "/usr/bin:/bin", "EDGELLM_CPUINFO": str(DATA / "zen2-epyc-7742.txt")}
    ok = subprocess.run(["python3", "-S", str(script), "check", "AVX", "AVX2"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == ""
    no = subprocess.run(["python3", "-S", str(script), "check", "AVX2", "AVX512_VBMI"], env=env, capture_output=True, text=True)
    assert no.returncode == 1 and no.stdout.strip() == "AVX512_VBMI (avx512vbmi)"
