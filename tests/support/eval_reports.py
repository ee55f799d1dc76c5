"""Eval reports built by hand, for tests of what renders them (plots, the
TUI's results table) without running an evaluation. Every figure not named
is a fixed placeholder; a test names the ones it checks."""

from __future__ import annotations

import dataclasses
from typing import Any

from quant.evaluate import EvalReport, LevelEval

# The placeholder of a figure by its declared type: a figure a test does not name
# only has to be there, so a field added to the report needs no edit here.
_PLACEHOLDER: dict[str, Any] = {"str": "", "int": 1, "float": 1.0}


def _placeholders(cls: type) -> dict[str, Any]:
    return {f.name: _PLACEHOLDER[f.type] for f in dataclasses.fields(cls) if f.type in _PLACEHOLDER}


def level_eval(name: str, level: str, size: int, kld: float) -> LevelEval:
    """One evaluated level of `size` bytes whose KLD figures are all `kld`."""
    kld_figures = dict.fromkeys(("kld_mean", "kld_median", "kld_p99", "kld_max"), kld)
    return LevelEval(**(_placeholders(LevelEval) | kld_figures | {"level": level, "name": name, "size_bytes": size}))


def eval_report(levels: list[LevelEval], **fields: Any) -> EvalReport:
    """A report of base m-f16 over `levels`; `fields` replace any of its figures."""
    return EvalReport(**(_placeholders(EvalReport) | {"base": "m-f16"} | fields), levels=levels)
