#!/usr/bin/env bash
# Writes an offline install bundle: everything an air-gapped x86-64 Linux
# machine needs to install edgellm with no network and no compiler.
#
#   scripts/offline_bundle.sh DIR [--model NAME]... [--python 3.11[,3.12]] [--llama-wheel WHL]
#
#   DIR/install.sh     run on the target: checks every file, creates the venv,
#                      installs, imports the models, runs `edgellm doctor`
#   DIR/wheels/        llama-cpp-python (the portable build when it is cached),
#                      edgellm, and every dependency for each --python version
#   DIR/models/        `edgellm export` of the --model NAMEs (optional)
#   DIR/bundle.json    what the bundle was made for (Python versions, platform, CPU)
#   DIR/SHA256SUMS     sha256 of every other file (`sha256sum -c` reads it too)
#
# Needs ./.venv from scripts/setup.sh and a package index on this side only.
# Wheels fetched once are kept in $EDGELLM_CACHE/bundle-wheels and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
source scripts/_cpu_flags.sh

DEST="" PYVERS="" LLAMA_WHEEL="" MODELS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODELS+=("${2:?--model needs a name}"); shift 2 ;;
        --python) PYVERS="${2:?--python needs versions, e.g. 3.11,3.12}"; shift 2 ;;
        --llama-wheel) LLAMA_WHEEL="$(realpath "${2:?--llama-wheel needs a file}")"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        -*) echo "offline_bundle.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$DEST" ] || { echo "offline_bundle.sh: one DIR only" >&2; exit 2; }; DEST="$(realpath -m "$1")"; shift ;;
    esac
done
[ -n "$DEST" ] || { sed -n '2,16p' "$0" >&2; exit 2; }
fail() { echo "offline_bundle.sh: $*" >&2; exit 1; }
say() { echo "[bundle] $*" >&2; }
VPY="$ROOT/.venv/bin/python"
[ -x "$VPY" ] || fail "no ./.venv: run scripts/setup.sh first"
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then fail "$DEST exists and is not empty"; fi
[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || fail "bundles are made for x86-64 Linux, on x86-64 Linux"
PYVERS="${PYVERS:-$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"

# The llama.cpp build: the portable one (every CPU variant, chosen at run time)
# when it is cached, else the one built for this machine's CPU flags.
HOST_ARGS="$(edgellm_cmake_args "")"
PORTABLE=false
if [ -z "$LLAMA_WHEEL" ]; then
    LLAMA_WHEEL="$(ls "$EDGELLM_CACHE"/wheels/portable-*/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl 2>/dev/null | head -1 || true)"
    if [ -n "$LLAMA_WHEEL" ]; then PORTABLE=true; else
        LLAMA_WHEEL="$(ls "$EDGELLM_CACHE/wheels/$(edgellm_flags_key "$HOST_ARGS")"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl 2>/dev/null | head -1 || true)"
    fi
fi
[ -f "$LLAMA_WHEEL" ] || fail "no llama-cpp-python $LLAMA_CPP_PYTHON_VERSION wheel in $EDGELLM_CACHE/wheels: run scripts/setup.sh (or setup.sh --portable)"
case "$(dirname "$LLAMA_WHEEL")" in */portable-*) PORTABLE=true ;; esac
# A host-flags wheel runs only on CPUs with the same SIMD extensions: the
# target's install.sh checks them, by ggml's names, through the one table
# (edgellm/engine/cpu_features.tsv, carried in check/ with its reader).
NEEDS="" NEEDS_LINUX=""
if ! $PORTABLE; then
    NEEDS="$("$VPY" -m edgellm.engine.cpu_features needs "$HOST_ARGS")"
    NEEDS_LINUX="$("$VPY" -m edgellm.engine.cpu_features linux $NEEDS)"
    say "note: $(basename "$LLAMA_WHEEL") carries this machine's CPU flags ($NEEDS_LINUX); targets need them too. scripts/setup.sh --portable builds one for every x86-64 CPU"
fi

TMP="$(dirname "$DEST")/.$(basename "$DEST").partial-$$"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/wheels" "$(dirname "$DEST")"
cp "$LLAMA_WHEEL" "$TMP/wheels/"

say "building edgellm's wheel"
"$VPY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$TMP/wheels" "$ROOT" >"$TMP/wheel.log" 2>&1 \
    || { cat "$TMP/wheel.log" >&2; fail "could not build edgellm's wheel"; }
rm -f "$TMP/wheel.log"
EWHEEL="$(ls "$TMP"/wheels/edgellm-*.whl)"
EVERSION="$(basename "$EWHEEL" | cut -d- -f2)"

# The versions this checkout runs with in .venv, so the target gets what was tested.
"$VPY" -m pip freeze --disable-pip-version-check 2>/dev/null \
    | grep -E '^[A-Za-z0-9_.-]+==' | grep -viE '^(edgellm|llama[-_]cpp[-_]python)==' > "$TMP/constraints.txt" || true
PLATFORMS=""
for t in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_25 manylinux_2_24 manylinux_2_17 manylinux2014 \
         manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1 linux; do PLATFORMS="$PLATFORMS --platform ${t}_x86_64"; done
CACHE="$EDGELLM_CACHE/bundle-wheels"
mkdir -p "$CACHE"
for V in ${PYVERS//,/ }; do
    case "$V" in 3.1[0-9]) ;; *) fail "--python takes 3.10 or newer (got $V)" ;; esac
    ABI="cp${V/./}"
    say "dependencies for Python $V ($ABI, x86-64 Linux)"
    dl() {
        "$VPY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$V" \
            --implementation cp --abi "$ABI" --abi abi3 --abi none $PLATFORMS -c "$TMP/constraints.txt" \
            --find-links "$TMP/wheels" --find-links "$CACHE" -d "$TMP/dl-$V" "$@" "$EWHEEL[serve]" pip 2>&1 \
            | grep -v "^WARNING: Location" || true
    }
    # Everything from the cache when it holds it all; else the package index fills the gaps.
    dl --no-index >/dev/null
    if ! ls "$TMP/dl-$V"/edgellm-*.whl >/dev/null 2>&1; then rm -rf "$TMP/dl-$V"; dl; fi
    ls "$TMP/dl-$V"/edgellm-*.whl >/dev/null 2>&1 || fail "could not download the dependencies for Python $V (see above)"
    for f in "$TMP/dl-$V"/*.whl; do
        case "${f##*/}" in edgellm-*|llama_cpp_python-*) ;; *) [ -e "$CACHE/${f##*/}" ] || cp "$f" "$CACHE/" ;; esac
        [ -e "$TMP/wheels/${f##*/}" ] || cp "$f" "$TMP/wheels/"
    done
    rm -rf "$TMP/dl-$V"
done
rm -f "$TMP/constraints.txt"

if [ ${#MODELS[@]} -gt 0 ]; then
    say "exporting ${MODELS[*]}"
    "$ROOT/.venv/bin/edgellm" export "${MODELS[@]}" --to "$TMP/models" --json >/dev/null
fi
cp scripts/offline_install.sh "$TMP/install.sh"
mkdir -p "$TMP/check"
cp edgellm/engine/cpu_features.py edgellm/engine/cpu_features.tsv "$TMP/check/"
chmod +x "$TMP/install.sh"

"$VPY" - "$TMP" "$PYVERS" "$(basename "$LLAMA_WHEEL")" "$PORTABLE" "$NEEDS" "$NEEDS_LINUX" "$EVERSION" "${MODELS[@]}" <<'EOF'
import hashlib, json, sys, time
from pathlib import Path
root, pyvers, llama, portable, needs, needs_linux, version, *models = sys.argv[1:]
meta = {
    "format": "edgellm-offline-bundle", "version": 1,
    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "edgellm_version": version, "python": pyvers.split(","), "platform": "linux-x86_64",
    # cpu_features: ggml's names, checked by install.sh; cpu_flags: the same in /proc/cpuinfo's spelling, to read
    "llama_cpp_python": {"wheel": llama, "portable": portable == "true", "cpu_features": needs.split(),
                         "cpu_flags": needs_linux.split()},
    "models": models,
}
(Path(root) / "bundle.json").write_text(json.dumps(meta, indent=1) + "\n")
lines = []
for p in sorted(Path(root).rglob("*")):
    if p.is_file() and p.name != "SHA256SUMS":
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        lines.append(f"{h.hexdigest()}  {p.relative_to(root).as_posix()}\n")
(Path(root) / "SHA256SUMS").write_text("".join(lines))
EOF
[ -d "$DEST" ] && rmdir "$DEST"
mv "$TMP" "$DEST"
trap - EXIT
say "done: $DEST ($(du -sh "$DEST" | cut -f1), $(ls "$DEST/wheels" | wc -l) wheels). On the target: $(basename "$DEST")/install.sh"
echo "$DEST"
