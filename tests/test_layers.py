"""The import-linter contracts in pyproject.toml bite: a wrong-way import fails `lint-imports`.

The three packages and pyproject.toml are copied into tmp_path, one import
against the layers is added to a core module there, and `lint-imports` runs on
that copy (first on PYTHONPATH, so the copy is what it reads, not the
installed checkout). The untouched copy must pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LINT = Path(sys.executable).with_name("lint-imports")


def contract(kind: str) -> str:
    """The name of pyproject's import-linter contract of type `kind`."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    names = [c["name"] for c in contracts if c["type"] == kind]
    assert len(names) == 1, (kind, names)
    return names[0]


def copy_project(dest: Path) -> Path:
    for pkg in ("edgellm", "quant", "tui"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def lint(project: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(project))
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo", str(project / "pyproject.toml")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def add_import(module: Path, line: str) -> None:
    text = module.read_text()
    anchor = "from __future__ import annotations\n"
    assert anchor in text, module
    module.write_text(text.replace(anchor, anchor + "\n" + line + "\n", 1))


def test_the_untouched_copy_passes(tmp_path):
    res = lint(copy_project(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "BROKEN" not in res.stdout and res.stdout.count("KEPT") >= 3, res.stdout


@pytest.mark.parametrize(
    "module, line, kind",
    [
        ("edgellm/gguf/reader.py", "import tui  # noqa: F401", "forbidden"),
        ("edgellm/gguf/reader.py", "from quant import levels  # noqa: F401", "forbidden"),
        ("edgellm/engine/hardware.py", "import edgellm.cli  # noqa: F401", "forbidden"),
        # inside the core, downwards only: the reader may not reach up into the model store
        ("edgellm/gguf/reader.py", "import edgellm.models.store  # noqa: F401", "layers"),
        ("quant/levels.py", "import tui.app  # noqa: F401", "layers"),
    ],
)
def test_a_wrong_way_import_fails_naming_the_contract(tmp_path, module, line, kind):
    project = copy_project(tmp_path)
    add_import(project / module, line)
    res = lint(project)
    assert res.returncode != 0, res.stdout[-3000:]
    name = contract(kind)
    # the summary line is "<contract name> BROKEN" (wrapped at 80 columns in the report)
    assert " ".join(f"{name} BROKEN".split()) in " ".join(res.stdout.split()), res.stdout[-3000:]
    importer = module.removesuffix(".py").replace("/", ".")
    assert importer in res.stdout, res.stdout[-3000:]
