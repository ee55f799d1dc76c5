"""edgellm/models/catalog.py: refs, a good and a bad models.toml, and the real one."""

from __future__ import annotations

import re

import pytest
from support.helpers import ROOT, assert_one_line_error

from edgellm.errors import CatalogError
from edgellm.models.catalog import load_catalog, parse_ref

GOOD = """
[[model]]
name = "Tiny-Chat"
display = "Tiny Chat"
architecture = "llama"
parameters = 1000
context_length = 2048
repo = "edge/tiny-GGUF"
default = true
default_level = "Q4_1"

[model.files]
Q8_0 = "tiny-Q8_0.gguf"
f16 = ["tiny-f16-00001-of-00002.gguf", "tiny-f16-00002-of-00002.gguf"]

[model.package]
requirement = "tiny-wheel==1.0"
member = "tiny/tiny.Q4_1.gguf"
level = "Q4_1"
sha256 = "ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789"
size_bytes = 1234

[[model]]
name = "other"
repo = "edge/other-GGUF"

[model.files]
q5_k_m = "other-Q5_K_M.gguf"
q4_k_m = "other-Q4_K_M.gguf"
"""


@pytest.mark.parametrize(
    "ref, want",
    [
        ("smollm2-135m-instruct", ("smollm2-135m-instruct", None)),
        ("qwen2.5-1.5b-instruct:Q5_K_M", ("qwen2.5-1.5b-instruct", "q5_k_m")),
        ("name:", ("name", None)),
        ("name:q8_0", ("name", "q8_0")),
    ],
)
def test_parse_ref(ref, want):
    assert parse_ref(ref) == want


def test_good_catalog(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(GOOD)
    cat = load_catalog(path)
    assert cat.path == path and [e.name for e in cat.entries] == ["tiny-chat", "other"]  # names lowercased
    tiny = cat.get("TINY-CHAT")
    assert tiny is cat.default and tiny.display == "Tiny Chat" and tiny.context_length == 2048
    # levels lowercased, a split set kept as its shard list, the package level counted as a level
    assert tiny.files == {"q8_0": ["tiny-Q8_0.gguf"], "f16": ["tiny-f16-00001-of-00002.gguf", "tiny-f16-00002-of-00002.gguf"]}
    assert tiny.levels == ["q8_0", "f16", "q4_1"] and tiny.default_level == "q4_1"
    pkg = tiny.package
    assert (pkg.requirement, pkg.level, pkg.size_bytes, pkg.index) == ("tiny-wheel==1.0", "q4_1", 1234, "pypi")
    assert pkg.sha256 == pkg.sha256.lower()
    other = cat.get("other")
    # no default_level: the first listed file's level; optional fields default, no package
    assert other.default_level == "q5_k_m" and other.package is None and other.default is False
    assert other.display == "other" and other.parameters == 0
    assert cat.find("nope") is None
    with pytest.raises(CatalogError, match="'nope' is not in the catalog"):
        cat.get("nope")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[[model]\nname = 'x'", "is not valid TOML"),
        ("[[model]]\nrepo = 'edge/x'\n", "entry 1 is malformed ('name')"),
        (
            GOOD + "\n[[model]]\nname = 'bad'\n[model.files]\nq8_0 = '../escape.gguf'\n",
            "entry 3 is malformed (unsafe filename '../escape.gguf')",
        ),
        ("[[model]]\nname = 'abs'\n[model.files]\nq8_0 = '/etc/passwd'\n", "unsafe filename"),
        ("[[model]]\nname = 'bad/name'\n", "entry 1:"),
        (
            "[[model]]\nname = 'p'\n[model.package]\nrequirement = 'x==1'\nmember = 'a.gguf'\nlevel = 'q4_1'\nsize_bytes = 1\n",
            "entry 1 is malformed ('sha256')",
        ),
        ("[[model]]\nname = 'n'\nparameters = 'many'\n", "entry 1 is malformed"),
    ],
)
def test_bad_catalog_is_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(CatalogError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert msg.startswith(f"catalog {path}") and needle in msg, msg
    assert "\n" not in msg


def test_missing_catalog_and_no_default(tmp_path):
    with pytest.raises(CatalogError, match="not found"):
        load_catalog(tmp_path / "absent.toml")
    path = tmp_path / "models.toml"
    path.write_text("[[model]]\nname = 'only'\n")
    with pytest.raises(CatalogError, match="no default model"):
        _ = load_catalog(path).default


def test_bad_catalog_through_the_cli(cli, tmp_path, monkeypatch):
    path = tmp_path / "models.toml"
    path.write_text("[[model]]\nname = 'x'\n[model.files]\nq8_0 = '../up.gguf'\n")
    monkeypatch.setenv("EDGELLM_CATALOG", str(path))
    res = cli("models", "list")
    assert_one_line_error(res)
    assert "unsafe filename" in res.stderr and str(path) in res.stderr


def test_the_real_catalog():
    cat = load_catalog(ROOT / "models.toml")
    names = [e.name for e in cat.entries]
    assert len(names) == len(set(names)) >= 6
    assert [e.name for e in cat.entries if e.default] == ["smollm2-135m-instruct"]
    pkg = cat.default.package
    assert pkg is not None and re.fullmatch(r"[0-9a-f]{64}", pkg.sha256) and pkg.size_bytes > 0
    for e in cat.entries:
        assert e.default_level in e.levels, e.name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e.repo), e.name
