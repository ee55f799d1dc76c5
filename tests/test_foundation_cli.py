"""Issue 2's promises through the CLI: pull, inspect, import errors, doctor, --help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.helpers import (
    DEFAULT_NAME,
    DEFAULT_REF,
    DEFAULT_SHA256,
    DEFAULT_SIZE,
    DEFAULT_SOURCE,
    assert_one_line_error,
    store_snapshot,
)


def test_pull_default_registers_verified_model(default_gguf, cli):
    # The session fixture pulled it through edgellm itself; a second pull is a no-op.
    res = cli("pull", DEFAULT_REF, "--json", "--no-progress")
    assert res.exit_code == 0, res
    rec = res.json()
    assert rec["name"] == DEFAULT_NAME
    assert rec["sha256"] == DEFAULT_SHA256
    assert rec["source"] == DEFAULT_SOURCE
    listed = cli("models", "list", "--json").json()
    m = next(m for m in listed["models"] if m["name"] == DEFAULT_NAME)
    assert set(m) >= {"name", "path", "size_bytes", "sha256", "level", "source", "parent"}
    assert m["level"] == "q4_1" and m["size_bytes"] == DEFAULT_SIZE and m["parent"] is None
    assert len(listed["catalog"]) >= 6


def test_inspect_default_reports_llama_135m_q4_1(default_model, cli):
    res = cli("inspect", DEFAULT_REF, "--json")
    assert res.exit_code == 0, res
    info = res.json()
    assert info["architecture"] == "llama"
    assert 130e6 < info["parameters"] < 140e6
    assert info["level"] == "q4_1"
    assert info["has_chat_template"] is True
    assert info["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert 5.5 < info["bpw"] < 6.0
    text = cli("inspect", DEFAULT_NAME)
    assert "Q4_1" in text.stdout and "llama" in text.stdout


def test_import_copies_validates_and_registers(default_gguf, cli, edgellm_home):
    res = cli("import", str(default_gguf), "--name", "mine", "--json")
    assert res.exit_code == 0, res
    rec = res.json()[0]
    assert rec["sha256"] == DEFAULT_SHA256
    assert rec["path"].startswith(str(edgellm_home))
    again = cli("import", str(default_gguf), "--name", "mine")
    assert_one_line_error(again)
    assert cli("rm", "mine").exit_code == 0
    assert not (edgellm_home / "models" / "mine").exists()


@pytest.mark.parametrize("kind", ["text", "truncated", "missing"])
def test_import_bad_input_is_one_line_error_and_store_unchanged(kind, default_gguf, cli, tmp_path, edgellm_home):
    if kind == "text":
        path = tmp_path / "notes.gguf"
        path.write_text("this is not a model\n" * 100)
    elif kind == "truncated":
        path = tmp_path / "cut.gguf"
        with open(default_gguf, "rb") as fh:
            path.write_bytes(fh.read(100_000))
    else:
        path = tmp_path / "nope.gguf"
    cli("models", "list", "--local")  # creates nothing, but makes the snapshot comparable
    before = store_snapshot(edgellm_home)
    res = cli("import", str(path))
    assert_one_line_error(res)
    assert store_snapshot(edgellm_home) == before
    expected = {"text": "not a GGUF", "truncated": "truncated", "missing": "no such file"}[kind]
    assert expected in res.stderr


def test_doctor_json_passes_self_test(default_model, cli_subprocess):
    res = cli_subprocess("doctor", "--json")
    assert res.exit_code == 0, res
    rep = res.json()
    assert rep["self_test"]["ok"] is True and rep["self_test"]["tokens"] == 8
    assert "AVX2" in rep["cpu_features"] and "AVX2" in rep["compiled_features"]
    # Whatever the CPU has, the build must not use what it lacks (that is the SIGILL).
    assert rep["unsupported_in_build"] == []
    assert not any(f.startswith("AMX") for f in rep["compiled_features"])
    assert rep["ok"] is True
    from edgellm.engine.hardware import THP_MODE_PATH

    mode = THP_MODE_PATH.read_text().split("[")[1].split("]")[0] if THP_MODE_PATH.exists() else None
    assert rep["huge_pages"] == mode


@pytest.mark.parametrize(
    "text, mode",
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"), ("always madvise [never]\n", "never")],
)
def test_the_doctor_reads_the_huge_page_mode(tmp_path, text, mode):
    from edgellm.engine.hardware import huge_pages_mode

    f = tmp_path / "enabled"
    f.write_text(text)
    assert huge_pages_mode(f) == mode
    assert huge_pages_mode(tmp_path / "absent") is None


def test_doctor_names_the_signal_of_a_crashing_build(default_model, cli_subprocess):
    res = cli_subprocess("doctor", "--json", env={"EDGELLM_SELFTEST_CRASH": "SIGILL"})
    assert res.exit_code != 0
    rep = res.json()
    assert rep["self_test"]["signal"] == "SIGILL"
    assert "SIGILL in llama.cpp" in rep["self_test"]["message"]
    assert "Traceback" not in res.stderr
    text = cli_subprocess("doctor", env={"EDGELLM_SELFTEST_CRASH": "SIGILL"})
    assert_one_line_error(text)
    assert "rerun scripts/setup.sh" in text.stderr


def test_help_imports_nothing_heavy():
    # `edgellm --help` must stay fast: none of these may load just to list commands.
    code = (
        "import sys; from edgellm.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('llama_cpp', 'numpy', 'textual', 'huggingface_hub', 'gguf', 'jinja2', 'psutil') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert "quantize" in out.stdout and "doctor" in out.stdout


def test_unknown_model_is_one_line_error(cli):
    res = cli("inspect", "no-such-model")
    assert_one_line_error(res)
    res = cli("inspect", DEFAULT_REF)  # in the catalog, not pulled
    assert_one_line_error(res)
    assert "edgellm pull" in res.stderr


def test_models_list_json_has_catalog_of_real_models(cli):
    data = cli("models", "list", "--json").json()
    params = sorted(e["parameters"] for e in data["catalog"])
    assert params[0] < 200e6 and params[-1] > 7e9
    default = [e for e in data["catalog"] if e["default"]]
    assert len(default) == 1 and default[0]["name"] == DEFAULT_REF
    assert json.dumps(data)
