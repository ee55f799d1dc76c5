"""`edgellm import --from ollama|lmstudio|hf [--link]`: GGUFs already in another tool's store.

Each store is laid out in tmp_path as the tool writes it (Ollama: manifest JSON
under manifests/<registry>/<namespace>/<model>/<tag> and sha256-named blobs,
the real default GGUF as the model layer; the HF cache: snapshots symlinked to
sha256-named blobs; LM Studio: publisher/model/file.gguf). Proven here: the
model is registered under the tool's name, `--link` costs no disk (the same
inode, or across file systems a reference to the very file), a blob whose
content does not match its sha256 name is refused in one line, `edgellm rm`
leaves the tool's file in place, and the registered model answers in chat.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from support.helpers import DEFAULT_SHA256 as DEFAULT_SHA
from support.helpers import DEFAULT_SIZE
from test_gguf_tiling import GAP_TENSOR, Q4_0, one_line_error, patch_tensor_type


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def ollama_store(
    root: Path, gguf: Path, *, manifests=(("registry.ollama.ai", "library", "smollm2", "135m"),), blob_name: str | None = None
) -> Path:
    """An Ollama models folder as `ollama pull` leaves it; returns the model blob."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    digest = blob_name or sha256(gguf)
    blob = root / "blobs" / f"sha256-{digest}"
    shutil.copyfile(gguf, blob)
    model_layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": blob.stat().st_size}
    template = _blob(
        root, b"{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
    )
    params = _blob(root, json.dumps({"stop": ["<|im_start|>", "<|im_end|>"]}).encode())
    config = _blob(
        root,
        json.dumps(
            {
                "model_format": "gguf",
                "model_family": "llama",
                "model_families": ["llama"],
                "model_type": "134.52M",
                "file_type": "Q4_1",
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": [model_layer["digest"], template["digest"], params["digest"]]},
            }
        ).encode(),
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": [
            model_layer,
            {"mediaType": "application/vnd.ollama.image.template", **template},
            {"mediaType": "application/vnd.ollama.image.params", **params},
        ],
    }
    for registry, namespace, model, tag in manifests:
        mf = root / "manifests" / registry / namespace / model / tag
        mf.parent.mkdir(parents=True, exist_ok=True)
        mf.write_text(json.dumps(manifest, separators=(",", ":")))
    return blob


@pytest.fixture
def ollama(default_gguf, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ollama-models"
    blob = ollama_store(
        root,
        default_gguf,
        manifests=(
            ("registry.ollama.ai", "library", "smollm2", "135m"),
            ("hf.co", "bartowski", "SmolLM2-135M-Instruct-GGUF", "Q4_1"),  # Ollama shares one blob between tags
        ),
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return blob


def test_lists_the_ollama_store_with_names_and_the_blob_sha(ollama, cli):
    res = cli("import", "--from", "ollama", "--json")
    assert res.exit_code == 0, res
    found = {m["name"]: m for m in res.json()}
    assert set(found) == {"smollm2:135m", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1"}
    m = found["smollm2:135m"]
    assert (m["store_name"], m["path"], m["sha256"], m["size_bytes"]) == ("smollm2-135m", str(ollama), DEFAULT_SHA, DEFAULT_SIZE)
    assert (
        found["hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1"]["store_name"]
        == "hf.co-bartowski-smollm2-135m-instruct-gguf-q4_1"
    )
    text = cli("import", "--from", "ollama")
    assert text.exit_code == 0, text
    assert "smollm2:135m" in text.stdout and "-> smollm2-135m" in text.stdout and " q4_1 " in text.stdout


def test_import_copies_under_the_ollama_name_and_chat_answers(ollama, cli, edgellm_home):
    res = cli("import", "--from", "ollama", "smollm2:135m", "--json")
    assert res.exit_code == 0, res
    rec = res.json()[0]
    assert rec["name"] == "smollm2-135m" and rec["sha256"] == DEFAULT_SHA and rec["source"] == "ollama:smollm2:135m"
    stored = Path(rec["path"])
    assert stored.parent == edgellm_home / "models" / "smollm2-135m" and stored.name == "smollm2-135m.gguf"
    assert stored.stat().st_ino != ollama.stat().st_ino and sha256(stored) == DEFAULT_SHA
    # the Ollama name resolves too (NAME:TAG -> NAME-TAG), and the model runs
    chat = cli(
        "chat", "smollm2:135m", "-p", "What is 2+2?", "--max-tokens", "8", "--seed", "1", "--temperature", "0", "--no-history"
    )
    assert chat.exit_code == 0, chat
    assert chat.stdout.strip()


def test_link_uses_the_same_inode_and_rm_leaves_the_blob(ollama, cli, edgellm_home):
    res = cli("import", "--from", "ollama", "smollm2:135m", "--link", "--json")
    assert res.exit_code == 0, res
    rec = res.json()[0]
    stored = Path(rec["path"])
    assert stored.stat().st_ino == ollama.stat().st_ino and ollama.stat().st_nlink == 2  # no second copy
    assert rec["extra"]["link"] == {"mode": "hardlink", "tool": "ollama", "origin": str(ollama)}
    listed = cli("models", "list", "--local", "--json").json()["models"]
    assert listed[0]["link"]["mode"] == "hardlink"
    text = cli("models", "list", "--local")
    assert f"[linked: hardlink to {ollama}]" in text.stdout
    rm = cli("rm", "smollm2-135m")
    assert rm.exit_code == 0 and f"{ollama} stays where it is" in rm.stdout, rm
    assert ollama.is_file() and ollama.stat().st_nlink == 1 and sha256(ollama) == DEFAULT_SHA
    assert not (edgellm_home / "models" / "smollm2-135m").exists()


def test_link_across_file_systems_is_a_reference(default_gguf, cli, monkeypatch, edgellm_home):
    """/dev/shm is a tmpfs: no hard link into the store is possible, so the store records the blob's path."""
    if os.stat("/dev/shm").st_dev == edgellm_home.parent.stat().st_dev:
        pytest.fail("/dev/shm is on the same file system as tmp_path; this test needs two")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        blob = ollama_store(Path(shm), default_gguf)
        monkeypatch.setenv("OLLAMA_MODELS", shm)
        res = cli("import", "--from", "ollama", "smollm2:135m", "--link", "--json")
        assert res.exit_code == 0, res
        rec = res.json()[0]
        assert rec["path"] == str(blob) and rec["extra"]["link"]["mode"] == "reference"
        assert blob.stat().st_nlink == 1
        assert not (edgellm_home / "models" / "smollm2-135m").exists()  # nothing written to the store's disk
        assert cli("rm", "smollm2-135m").exit_code == 0
        assert blob.is_file() and sha256(blob) == DEFAULT_SHA


@pytest.mark.parametrize("link", [False, True])
def test_a_blob_that_does_not_match_its_name_is_refused(ollama, cli, edgellm_home, link):
    with open(ollama, "r+b") as fh:  # one byte of tensor data: still a valid GGUF, no longer the named blob
        fh.seek(50_000_000)
        b = fh.read(1)
        fh.seek(50_000_000)
        fh.write(bytes([b[0] ^ 1]))
    res = cli("import", "--from", "ollama", "smollm2:135m", *(["--link"] if link else []))
    line = one_line_error(res)
    assert f"Ollama blob {ollama} is named for sha256 {DEFAULT_SHA[:12]}... but its content hashes to" in line
    assert "refusing 'smollm2:135m'" in line
    assert cli("models", "list", "--local", "--json").json()["models"] == []
    assert ollama.stat().st_nlink == 1
    assert not (edgellm_home / "models" / "smollm2-135m").exists()


def test_a_blob_whose_tensors_do_not_tile_is_refused(default_gguf, cli, tmp_path, monkeypatch):
    """Correctly named (its sha256 matches) but mislabelled inside: the tiling check catches it."""
    bad = patch_tensor_type(default_gguf, tmp_path / "bad.gguf", GAP_TENSOR, Q4_0)
    root = tmp_path / "ollama"
    ollama_store(root, bad)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    line = one_line_error(cli("import", "--from", "ollama", "smollm2:135m", "--link"))
    assert f"tensor '{GAP_TENSOR}' is declared Q4_0 [576, 1536]" in line
    assert cli("models", "list", "--local", "--json").json()["models"] == []


def test_unknown_names_and_missing_stores_are_one_line_errors(ollama, cli, tmp_path, monkeypatch):
    line = one_line_error(cli("import", "--from", "ollama", "llama3:8b"))
    assert "no model 'llama3:8b' in the Ollama store" in line
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    line = one_line_error(cli("import", "--from", "ollama"))
    assert f"no Ollama store at {tmp_path / 'nowhere'}" in line


def hf_cache(
    hub: Path, gguf: Path, repo="bartowski/SmolLM2-135M-Instruct-GGUF", filename="SmolLM2-135M-Instruct-Q4_1.gguf"
) -> Path:
    """The layout huggingface_hub writes: blobs named by sha256, snapshot entries as relative symlinks."""
    d = hub / ("models--" + repo.replace("/", "--"))
    commit = "0" * 8 + "f00d" * 8
    digest = sha256(gguf)
    (d / "blobs").mkdir(parents=True)
    shutil.copyfile(gguf, d / "blobs" / digest)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)
    snap = d / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / filename).symlink_to(Path("..") / ".." / "blobs" / digest)
    return d / "blobs" / digest


def test_hf_cache_link_points_at_the_blob(default_gguf, cli, tmp_path, monkeypatch):
    blob = hf_cache(tmp_path / "hub", default_gguf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    listed = cli("import", "--from", "hf", "--json").json()
    assert [(m["name"], m["store_name"], m["sha256"]) for m in listed] == [
        ("bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf", "smollm2-135m-instruct-q4_1", DEFAULT_SHA)
    ]
    res = cli("import", "--from", "hf", "smollm2-135m-instruct-q4_1", "--link", "--json")
    assert res.exit_code == 0, res
    stored = Path(res.json()[0]["path"])
    assert stored.stat().st_ino == blob.stat().st_ino and not stored.is_symlink()
    assert cli("rm", "smollm2-135m-instruct-q4_1").exit_code == 0
    assert blob.is_file() and blob.stat().st_nlink == 1


def test_hf_cache_blob_with_wrong_content_is_refused(default_gguf, cli, tmp_path, monkeypatch):
    blob = hf_cache(tmp_path / "hub", default_gguf)
    with open(blob, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    line = one_line_error(cli("import", "--from", "hf", "smollm2-135m-instruct-q4_1"))
    assert f"Hugging Face cache blob {blob} is named for sha256 {DEFAULT_SHA[:12]}..." in line


def test_lmstudio_models_folder_from_home_and_pointer(default_gguf, cli, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    f = home / ".lmstudio" / "models" / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct-Q4_1.gguf"
    f.parent.mkdir(parents=True)
    shutil.copyfile(default_gguf, f)
    (f.parent / "mmproj-SmolLM2-f16.gguf").write_bytes(b"GGUF")  # a projector: not listed as a model
    listed = cli("import", "--from", "lmstudio", "--json").json()
    assert [(m["name"], m["store_name"], m["sha256"]) for m in listed] == [
        ("lmstudio-community/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf", "smollm2-135m-instruct-q4_1", None)
    ]
    # LM Studio's own pointer file moves its home; the old folder is then ignored
    moved = tmp_path / "lm-elsewhere"
    (moved / "models" / "me" / "m").mkdir(parents=True)
    os.link(f, moved / "models" / "me" / "m" / "Other.Q4_1.gguf")
    (home / ".lmstudio-home-pointer").write_text(str(moved) + "\n")
    listed = cli("import", "--from", "lmstudio", "--json").json()
    assert [m["name"] for m in listed] == ["me/m/Other.Q4_1.gguf"]
    res = cli("import", "--from", "lmstudio", "me/m/Other.Q4_1.gguf", "--name", "other", "--link", "--json")
    assert res.exit_code == 0, res
    rec = res.json()[0]
    assert rec["name"] == "other" and rec["sha256"] == DEFAULT_SHA  # no reference hash: computed and recorded
    assert Path(rec["path"]).stat().st_ino == f.stat().st_ino


def test_plain_file_link(default_gguf, cli, tmp_path):
    src = tmp_path / "dl" / "model.gguf"
    src.parent.mkdir()
    shutil.copyfile(default_gguf, src)
    res = cli("import", src, "--link", "--json")
    assert res.exit_code == 0, res
    rec = res.json()[0]
    assert Path(rec["path"]).stat().st_ino == src.stat().st_ino and rec["sha256"] == DEFAULT_SHA
    assert cli("rm", rec["name"]).exit_code == 0
    assert src.is_file()


def test_a_bare_ollama_name_means_its_latest_tag(default_gguf, cli, tmp_path, monkeypatch):
    root = tmp_path / "ollama"
    ollama_store(
        root,
        default_gguf,
        manifests=(("registry.ollama.ai", "library", "smollm2", "latest"), ("registry.ollama.ai", "me", "tuned", "v1")),
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    assert [m["name"] for m in cli("import", "--from", "ollama", "--json").json()] == ["me/tuned:v1", "smollm2:latest"]
    res = cli("import", "--from", "ollama", "smollm2", "me/tuned:v1", "--link", "--json")
    assert res.exit_code == 0, res
    assert [r["name"] for r in res.json()] == ["smollm2-latest", "me-tuned-v1"]
