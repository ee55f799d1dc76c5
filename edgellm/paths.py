"""EDGELLM_HOME and the folders under it.

Everything edgellm writes lives under one root so that a user (or a test) can
move, back up or wipe it in one place. `EDGELLM_HOME` overrides the platform's
user data dir; the cache (downloaded wheels, built tools) is separate because
it can always be rebuilt.
"""

from __future__ import annotations

import os
from pathlib import Path

APP = "edgellm"


def home() -> Path:
    env = os.environ.get("EDGELLM_HOME")
    if env:
        return Path(env).expanduser().resolve()
    from platformdirs import user_data_dir  # platformdirs only when no EDGELLM_HOME/EDGELLM_CACHE is set

    return Path(user_data_dir(APP, appauthor=False))


def cache_dir() -> Path:
    env = os.environ.get("EDGELLM_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    from platformdirs import user_cache_dir  # platformdirs only when no EDGELLM_HOME/EDGELLM_CACHE is set

    return Path(user_cache_dir(APP, appauthor=False))


def models_dir() -> Path:
    return home() / "models"


def index_path() -> Path:
    return home() / "index.json"


def results_dir() -> Path:
    return home() / "results"


def history_dir() -> Path:
    return home() / "history"


def ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
