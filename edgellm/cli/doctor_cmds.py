"""doctor: is this install able to run models on this machine?"""

from __future__ import annotations

import sys

import click

from edgellm.cli.output import emit_json
from edgellm.engine import rpc, rpc_native
from edgellm.engine.hardware import doctor
from edgellm.errors import EdgeLLMError, ModelNotFound
from edgellm.fsutil import human_size
from edgellm.models.catalog import load_catalog
from edgellm.models.resolve import resolve


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--model", "model_ref", help="Model for the self-test (default: the default model, if pulled).")
@click.option("--no-self-test", is_flag=True, help="Skip the subprocess self-test.")
def doctor_cmd(as_json: bool, model_ref, no_self_test: bool) -> None:
    """Versions, CPU features vs the build, GPU backends, RAM, disk, and a self-test
    that loads a model and generates 8 tokens in a subprocess."""

    path = None
    try:
        if model_ref:
            path = resolve(model_ref).path
        else:
            path = resolve(load_catalog().default.name).path
    except ModelNotFound:
        if model_ref:
            raise
    rep = doctor(model_path=path, run_self_test=not no_self_test)
    if as_json:
        emit_json({**rep.to_json(), "rpc": _rpc_info()})
    else:
        st = rep.self_test
        click.echo(f"python            {rep.python} on {rep.platform}")
        click.echo(f"llama-cpp-python  {rep.llama_cpp_python}")
        click.echo(f"cpu               {rep.cpu}")
        click.echo(f"cpu features      {' '.join(rep.cpu_features) or '-'}")
        click.echo(f"compiled in       {' '.join(rep.compiled_features) or '-'}")
        if rep.cpu_backend:  # the portable build: which of its CPU variants runs here, and why
            cb = rep.cpu_backend
            click.echo(f"cpu backend       {cb['variant']} ({cb['source']}): {cb['reason']}")
            for v in cb["variants"]:
                click.echo(
                    f"  {v['name']:<16}score {v['score'] if v['score'] is not None else '-':>4}  {v['status'] or '-'}"
                    + (f": {v['reason']}" if v["reason"] else "")
                )
        gpu = rep.gpu
        click.echo(f"gpu backends      {', '.join(gpu.get('backends') or []) or 'none (CPU-only build)'}")
        for d in gpu.get("devices", []):
            soft = f"  ({d['note']})" if d.get("note") else ""
            click.echo(
                f"  device {d['index']:<8} {d['name']} [{d['backend']}, {d['kind']}] {d['description']}: "
                f"{human_size(d['free_bytes'])} free of {human_size(d['total_bytes'])}{soft}"
            )
        if gpu.get("backends") and gpu.get("note"):
            click.echo(f"  devices         none: {gpu['note']}")
        rpc = _rpc_info()
        click.echo(
            f"rpc               {'compiled in, protocol ' + rpc['protocol'] if rpc['compiled_in'] else 'not compiled in (rebuild with scripts/setup.sh)'}"
        )
        click.echo(f"ram               {human_size(rep.ram_total_bytes)} total, {human_size(rep.ram_available_bytes)} available")
        if rep.huge_pages is not None:
            asked = "off: weights on 4 KiB pages" if rep.huge_pages == "never" else "on for ggml's buffers"
            click.echo(f"huge pages        {rep.huge_pages} ({asked})")
        click.echo(f"store             {rep.home} ({human_size(rep.disk_free_bytes)} free)")
        if st.ok:
            click.echo(f"self-test         passed: {st.tokens} tokens at {st.tokens_per_second:.1f} tok/s ({st.text!r})")
        else:
            click.echo(f"self-test         {'FAILED: ' if st.message != 'skipped' else ''}{st.message}")
        for w in rep.warnings:
            click.echo(f"warning: {w}", err=True)
    if not rep.self_test.ok and rep.self_test.message != "skipped" or rep.unsupported_in_build:
        if not as_json:
            click.echo(f"error: {rep.self_test.message or 'the build does not match this CPU'}", err=True)
        sys.exit(1)


def _rpc_info() -> dict:
    """llama.cpp's RPC backend (`edgellm worker`, `--rpc`): in this build, and which protocol it speaks."""

    try:
        version = ".".join(map(str, rpc.local_version()))
    except EdgeLLMError:
        version = None
    return {"compiled_in": rpc_native.compiled_in() and version is not None, "protocol": version}
