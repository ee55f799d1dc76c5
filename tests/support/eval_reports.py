"""Eval reports built by hand, for tests of what renders them (plots, the
TUI's results table) without running an evaluation. Every figure not named
is a fixed placeholder; a test names the ones it checks."""

from __future__ import annotations

from typing import Any

from quant.evaluate import EvalReport, LevelEval


def level_eval(name: str, level: str, size: int, kld: float) -> LevelEval:
    """One evaluated level of `size` bytes whose KLD figures are all `kld`."""
    return LevelEval(
        level=level,
        name=name,
        path="",
        size_bytes=size,
        bpw=4.0,
        ppl=20.0,
        ppl_err=0.1,
        dppl_pct=5.0,
        kld_mean=kld,
        kld_err=0.01,
        kld_median=kld,
        kld_p99=kld,
        kld_max=kld,
        same_top_p=80.0,
        same_top_p_err=1.0,
        rms_dp=1.0,
        rms_dp_err=0.1,
        tokens_per_second=100.0,
        seconds=1.0,
    )


def eval_report(levels: list[LevelEval], **fields: Any) -> EvalReport:
    """A report of base m-f16 over `levels`; `fields` replace any of its figures."""
    base: dict[str, Any] = dict(
        base="m-f16",
        base_path="",
        base_level="f16",
        base_size_bytes=1,
        base_bpw=16.0,
        base_ppl=20.0,
        base_ppl_err=0.1,
        base_tokens_per_second=1.0,
        parameters=1,
        kv_bytes_per_token=1,
        corpus="x",
        corpus_sha256="",
        ctx=512,
        chunks=1,
        n_tokens_scored=1,
        batch=1,
        threads=1,
        topk=1,
        tail_samples=1,
        machine="",
        created=0.0,
    )
    return EvalReport(**{**base, **fields}, levels=levels)
