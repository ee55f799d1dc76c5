"""The CPU features llama.cpp builds for, read from the one table (cpu_features.tsv beside this file).

Each feature has four spellings: the cmake option, ggml's name, the Linux
/proc/cpuinfo flag and the macOS sysctl token. They differ in ways that are
easy to get wrong by hand (cmake's AVX512_VBMI is Linux's `avx512vbmi`, with
no underscore, beside `avx512_vbmi2`, with one), so every reader goes through
this table: `edgellm doctor` (engine.hardware), the portable variant choice
(engine.backends), scripts/_cpu_flags.sh (reads the TSV with awk), and the
offline bundle and its installer (which carry this file and the TSV, and run
it by path before anything is installed).

Standard library only, and runnable as a script by path (`python
cpu_features.py check ...`): the installer runs it before edgellm exists.

`EDGELLM_CPUINFO=FILE` reads FILE instead of /proc/cpuinfo (here and in
_cpu_flags.sh): the tests feed recorded flag lines of other CPUs through it,
and it checks a bundle against another machine's dump.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TABLE_PATH = Path(__file__).with_suffix(".tsv")
CPUINFO_ENV = "EDGELLM_CPUINFO"


@dataclass(frozen=True)
class Feature:
    cmake: Optional[str]  # GGML_AVX512_VBMI; None: no build option
    ggml: str  # AVX512_VBMI
    linux: str  # avx512vbmi
    macos: Optional[str]  # AVX512VBMI (x86) or hw.optional.arm.FEAT_DotProd (arm64); None: macOS has none
    arch: str  # "x86" or "arm64"
    build: str  # "host", "off" or "-" (see the TSV's header)
    shown: bool = True  # llama_print_system_info names it when compiled in

    def label(self) -> str:
        """ggml's name with the Linux flag it is read from: `AVX512_VBMI (avx512vbmi)`."""
        return f"{self.ggml} ({self.linux})"


def _load(path: Path = TABLE_PATH) -> list[Feature]:
    rows: list[Feature] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#") or line.startswith("cmake\t"):
            continue
        cmake, ggml, linux, macos, arch, build, shown = line.split("\t")
        rows.append(
            Feature(None if cmake == "-" else cmake, ggml, linux, None if macos == "-" else macos, arch, build, shown == "yes")
        )
    return rows


TABLE: list[Feature] = _load()
BY_GGML: dict[str, Feature] = {f.ggml: f for f in TABLE}


def arch_of(machine: Optional[str] = None) -> str:
    """ "x86" or "arm64" for a `platform.machine()` string; other architectures are neither."""
    m = (machine or platform.machine()).lower()
    if m in ("x86_64", "amd64", "i686", "i386"):
        return "x86"
    if m in ("aarch64", "arm64"):
        return "arm64"
    return m


def features(arch: Optional[str] = None) -> list[Feature]:
    arch = arch or arch_of()
    return [f for f in TABLE if f.arch == arch]


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(arch, flags) of the first `flags` (x86) or `Features` (arm64) line of a /proc/cpuinfo dump."""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return ("x86" if line.startswith("flags") else "arm64"), set(line.split(":", 1)[1].split())
    return arch_of(), set()


@dataclass(frozen=True)
class HostFlags:
    """What the OS says a CPU may run, in its own spelling (`os`: "linux" or "macos")."""

    os: str
    flags: frozenset[str]
    source: str  # the file or command read
    arch: str = ""  # "x86" or "arm64": a recorded dump says which; "" is this machine's

    def __post_init__(self) -> None:
        if not self.arch:
            object.__setattr__(self, "arch", arch_of())


def host_flags() -> Optional[HostFlags]:
    """The kernel's list (it leaves out what XSAVE/XCR0 does not enable: AVX-512 or AMX state under
    some hypervisors); None when there is nothing to read."""
    path = os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo"
    try:
        arch, flags = parse_cpuinfo(Path(path).read_text(encoding="utf-8", errors="replace"))
        return HostFlags("linux", frozenset(flags), path, arch)
    except OSError:
        pass
    if sys.platform == "darwin":
        return HostFlags("macos", frozenset(_sysctl_tokens()), "sysctl")
    return None


def _sysctl_tokens() -> set[str]:
    tokens: set[str] = set()
    for args in (["machdep.cpu.features", "machdep.cpu.leaf7_features"], ["hw.optional"]):
        try:
            out = subprocess.run(["sysctl", *args], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.startswith("machdep.cpu."):
                tokens.update(value.split())
            elif value.strip() == "1":  # hw.optional.arm.FEAT_DotProd: 1
                tokens.add(key.strip())
    return tokens


def has(feature: Feature, host: HostFlags) -> bool:
    name = feature.linux if host.os == "linux" else feature.macos
    return name is not None and name in host.flags


def present(host: Optional[HostFlags]) -> list[str]:
    """ggml's names of the features `host` lists, in table order."""
    if host is None:
        return []
    return [f.ggml for f in features(host.arch) if has(f, host)]


def missing(needs: Iterable[str], host: HostFlags) -> list[Feature]:
    """The features of `needs` (ggml's names) that `host` does not list; an unknown name is missing
    too (a bundle from a newer edgellm: better refused than crashing)."""
    out = []
    for name in needs:
        f = BY_GGML.get(name)
        if f is None:
            out.append(Feature(None, name, name.lower(), None, "?", "-"))
        elif not has(f, host):
            out.append(f)
    return out


def needs_of_cmake_args(args: str) -> list[str]:
    """ggml's names of the features a set of cmake arguments turns ON (`-DGGML_AVX2=ON` → AVX2)."""
    on = {a[2:-3] for a in args.split() if a.startswith("-D") and a.endswith("=ON")}
    return [f.ggml for f in TABLE if f.cmake in on]


def _main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_features", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("needs", help="ggml's names of the features cmake ARGS turn on, one line")
    n.add_argument("args")
    lx = sub.add_parser("linux", help="the Linux spellings of ggml's NAMEs, one line")
    lx.add_argument("names", nargs="*")
    c = sub.add_parser("check", help="exit 1 naming the features of NAMEs this CPU lacks")
    c.add_argument("names", nargs="*")
    sub.add_parser("present", help="ggml's names of the features this CPU and OS have")
    a = p.parse_args(argv)
    if a.cmd == "needs":
        print(" ".join(needs_of_cmake_args(a.args)))
    elif a.cmd == "linux":
        print(" ".join(BY_GGML[x].linux if x in BY_GGML else x.lower() for x in a.names))
    elif a.cmd == "present":
        print(" ".join(present(host_flags())))
    else:
        host = host_flags()
        if host is None:  # nothing to read: the doctor's self-test after the install is the check
            return 0
        lack = missing(a.names, host)
        if lack:
            print(", ".join(f.label() for f in lack))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
