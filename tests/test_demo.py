"""The README's first command as a user meets it: a fresh clone with nothing
beside it (no ../shared, so no WikiText-2) and an empty EDGELLM_HOME.

It reuses the llama.cpp wheel cached for this CPU (EDGELLM_CACHE) and pip's
download cache, so it costs the demo's own work (~2-4 min on 2 cores), not a
build.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support.helpers import shared_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_from_a_bare_clone_ends_with_a_recommendation(tmp_path):
    clone = tmp_path / "user" / "edgellm"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    assert not (clone.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGELLM_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(EDGELLM_HOME=str(tmp_path / "empty-home"), EDGELLM_CACHE=str(shared_cache()))
    proc = subprocess.run(["scripts/demo.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert "built-in corpus" in out and "WikiText-2 is not at" in out
    # the demo ends with recommend's answer: its choice, then its reason
    tail = proc.stdout.rstrip().splitlines()
    best = [ln for ln in tail[-4:] if ln.startswith("best: smollm2-135m-instruct-")]
    assert best and "mean KLD" in best[0] and "python-docs" in best[0], tail[-6:]
