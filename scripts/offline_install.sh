#!/usr/bin/env bash
# edgellm offline installer (written into a bundle by scripts/offline_bundle.sh).
#
#   ./install.sh [--venv DIR]      default DIR: $EDGELLM_VENV or ~/.local/share/edgellm/venv
#
# Needs only Python >= 3.10 (PYTHON=/path/to/python picks one): no network, no
# compiler. Before anything is installed it checks every file against
# SHA256SUMS, that every wheel is there, and that this Python, platform and CPU
# are ones the bundle was made for; any failure is one line and nothing changes.
# Then: a venv, `pip install --no-index` from wheels/, the bundled models
# imported into the store (EDGELLM_HOME if set), `edgellm doctor` with its
# self-test, and the next command to run.
set -euo pipefail
BUNDLE="$(cd "$(dirname "$0")" && pwd)"
VENV="${EDGELLM_VENV:-$HOME/.local/share/edgellm/venv}"
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV="${2:?--venv needs a folder}"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
die() { echo "error: $*" >&2; exit 1; }
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
cd "$BUNDLE"  # `python -` puts the working folder first on sys.path: never let it shadow the install
say() { echo "[install] $*"; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then PY="$(command -v "$c")"; break; fi
    done
    [ -n "$PY" ] || die "install.sh needs Python >= 3.10 and found none on PATH (set PYTHON=/path/to/python3); nothing was installed"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
    || die "$PY is not Python >= 3.10; nothing was installed"

# Every check before the first change, in the Python we are about to use.
"$PY" - "$BUNDLE" "$PY" <<'EOF' || exit 1
import hashlib, json, platform, sys
from pathlib import Path

root, py = Path(sys.argv[1]), sys.argv[2]

def refuse(msg):
    print(f"error: {msg}; nothing was installed", file=sys.stderr)
    sys.exit(1)

try:
    sums = (root / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    meta = json.loads((root / "bundle.json").read_text(encoding="utf-8"))
except (OSError, ValueError) as e:
    refuse(f"{root} is not a complete edgellm bundle ({e.__class__.__name__}: {str(e)[:100]})")
listed = {}
for line in sums:
    sha, _, rel = line.partition("  ")
    if len(sha) != 64 or not rel or rel.startswith("/") or ".." in rel.split("/"):
        refuse(f"SHA256SUMS has a malformed line {line[:80]!r}")
    listed[rel] = sha
for rel, want in listed.items():
    p = root / rel
    if not p.is_file():
        refuse(f"bundle file {rel} is missing")
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != want:
        refuse(f"bundle file {rel} was changed or damaged (sha256 {h.hexdigest()[:12]}..., SHA256SUMS says {want[:12]}...)")
for p in sorted(root.rglob("*")):
    rel = p.relative_to(root).as_posix()
    if p.is_file() and rel != "SHA256SUMS" and rel not in listed and not rel.startswith(("venv/", ".")):
        refuse(f"bundle file {rel} is not in SHA256SUMS (added after the bundle was made)")
if not any(r.startswith("wheels/edgellm-") for r in listed):
    refuse("the bundle holds no edgellm wheel")
if meta.get("format") != "edgellm-offline-bundle":
    refuse("bundle.json is not an edgellm offline bundle's")
ver = "%d.%d" % sys.version_info[:2]
if ver not in meta.get("python", []):
    refuse(f"this bundle was made for Python {', '.join(meta.get('python', []))} and {py} is Python {ver} "
           "(run with PYTHON=/path/to/a matching python, or make the bundle with --python " + ver + ")")
machine = f"{sys.platform}-{platform.machine().lower()}".replace("amd64", "x86_64")
if machine != meta.get("platform"):
    refuse(f"this bundle was made for {meta.get('platform')}, this machine is {machine}")
needs = meta.get("llama_cpp_python", {}).get("cpu_features", [])
if needs:
    # the one CPU-feature table and its reader, as the bundle carries them (checked against SHA256SUMS above)
    import importlib.util
    sys.dont_write_bytecode = True  # the bundle stays as SHA256SUMS lists it (and may be read-only)
    spec = importlib.util.spec_from_file_location("cpu_features", root / "check" / "cpu_features.py")
    cpu = importlib.util.module_from_spec(spec)
    sys.modules["cpu_features"] = cpu  # dataclasses look their module up by name
    spec.loader.exec_module(cpu)
    host = cpu.host_flags()  # EDGELLM_CPUINFO=FILE reads another CPU's recorded flags instead
    lack = cpu.missing(needs, host) if host is not None else []  # nothing to read: the doctor's self-test is the check
    if lack:
        refuse(f"this bundle's llama.cpp was built for CPUs with {', '.join(f.label() for f in lack)}, which this CPU lacks "
               "(make the bundle from a portable build: scripts/setup.sh --portable)")
EOF

# pip reads no configuration or index from this machine: the bundle is the only source.
for v in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
VERSION="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["edgellm_version"])' "$BUNDLE/bundle.json")"
FIRST_MODEL="$("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1]))["models"]; print(m[0] if m else "")' "$BUNDLE/bundle.json")"

say "creating the venv $VENV with $("$PY" --version)"
if [ ! -x "$VENV/bin/python" ]; then
    # --without-pip: Debian's python3 lacks ensurepip unless python3-venv is
    # installed; pip comes from the bundle's own wheel instead.
    "$PY" -m venv --without-pip "$VENV" || die "could not create the venv $VENV"
fi
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    PIPWHL="$(ls "$BUNDLE"/wheels/pip-*.whl | head -1)"
    "$VENV/bin/python" "$PIPWHL/pip" install -q --no-index --find-links "$BUNDLE/wheels" pip \
        || die "could not install pip into $VENV from $PIPWHL"
fi
say "installing edgellm $VERSION and its dependencies from $BUNDLE/wheels (no network)"
"$VENV/bin/python" -m pip install -q --no-index --find-links "$BUNDLE/wheels" "edgellm[serve]==$VERSION" \
    || die "pip could not install from $BUNDLE/wheels (see above)"
EDGELLM="$VENV/bin/edgellm"

if [ -d "$BUNDLE/models" ]; then
    # A rerun finds the models already there: import only when none is registered yet.
    present="$("$VENV/bin/python" - "$BUNDLE/models" <<'EOF'
import json, sys
from pathlib import Path
from edgellm.models.store import Store
names = [m["name"] for m in json.loads((Path(sys.argv[1]) / "manifest.json").read_text())["models"]]
have = [n for n in names if Store().find(n)]
print("all" if len(have) == len(names) else ("none" if not have else "some:" + ",".join(have)))
EOF
)"
    case "$present" in
        all) say "the bundled models are already in the store" ;;
        none) say "importing the bundled models (each file's sha256 checked)"; "$EDGELLM" import "$BUNDLE/models" ;;
        *) die "the store already holds ${present#some:} (not all the bundled models); remove them with \`$EDGELLM rm\` and rerun" ;;
    esac
fi

say "checking the install: edgellm doctor${FIRST_MODEL:+ (self-test with $FIRST_MODEL)}"
"$EDGELLM" doctor ${FIRST_MODEL:+--model "$FIRST_MODEL"} || die "edgellm doctor found a problem (above); the install is in $VENV"
say "done."
if [ -n "$FIRST_MODEL" ]; then
    echo "next: $EDGELLM chat $FIRST_MODEL        (or: source $VENV/bin/activate; edgellm chat $FIRST_MODEL)"
else
    echo "next: $EDGELLM import /path/to/model.gguf   (or: edgellm import --from ollama --link)"
fi
