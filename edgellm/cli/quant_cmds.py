"""quantize / convert: thin wrappers over quant.quantize and quant.convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from edgellm.cli.output import emit_json, running_job
from edgellm.errors import UsageError
from edgellm.fsutil import human_size
from edgellm.units import SIZE_HELP

# quantize and convert write a model file the same way, so they refuse or replace an existing one alike
_force_option = click.option("--force", is_flag=True, help="Replace an existing output of the same name.")


# long: the click options (levels, --imatrix, --budget, --recipe, output) are the interface; the body translates them
@click.command("quantize")
@click.argument("model")
@click.option(
    "-l",
    "--level",
    "levels",
    multiple=True,
    help="Level to write (q4_0, q4_k_m, q5_k_m, q8_0, iq4_xs, f16, ...); repeat or comma-separate for several. Case-insensitive.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Output file (one level) or folder. Default: the store, named <base>-<level>.",
)
@click.option("--threads", type=int, help="Threads for llama.cpp in all (default: physical cores).")
@click.option(
    "--jobs",
    type=int,
    help="Levels quantized side by side, sharing --threads (default: 2 when RAM allows; 1: one after another).",
)
@click.option("--allow-requantize", is_flag=True, help="Allow an already-quantized input (the errors compound).")
@click.option(
    "--imatrix",
    metavar="NAME|FILE|auto",
    help="Importance matrix: a stored one (`edgellm imatrix`), an imatrix GGUF file, or auto (this model's "
    "newest, else computed now on the shipped calibration text). Needed by iq1_*, iq2_*, iq3_xxs, "
    "iq3_xs, q2_k_s.",
)
@click.option(
    "--budget",
    metavar="SIZE",
    help=f"Instead of --level: the best file within SIZE (100MB, 95MiB, 4.5bpw, or ram; {SIZE_HELP}), one type per tensor "
    "chosen from measured sensitivity on the calibration text. Uses --imatrix (default auto).",
)
@click.option("--exclude-types", default="", metavar="LIST", help="Types --budget may not use (comma-separated, e.g. q4_1).")
@click.option(
    "--error-feedback/--no-error-feedback",
    default=None,
    help="With --budget (on by default where free RAM allows): round the matrices it puts in Q4_0/Q4_1/Q5_0/Q5_1/"
    "Q8_0/Q6_K column by column, feeding each column's error forward (GPTQ), from one more pass over the "
    "calibration text. Same size, lower KLD, a slower job. --no-error-feedback: a faster job whose file "
    "llama-quantize reproduces from the recipe's .txt (the rounding line says how); --error-feedback: refuse "
    "rather than go without.",
)
@click.option(
    "--recipe",
    "recipe_file",
    type=click.Path(path_type=Path),
    help="Instead of --level: apply a saved --budget recipe (JSON) to a model of the same architecture.",
)
@_force_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: a list, one object per level.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def quantize_cmd(
    model,
    levels,
    output,
    threads,
    jobs,
    allow_requantize,
    imatrix,
    budget,
    exclude_types,
    error_feedback,
    recipe_file,
    force,
    as_json,
    no_progress,
) -> None:
    """Quantize MODEL (an F32/F16/BF16 GGUF: store name or path) with llama.cpp.

    Each level is written to a temporary file beside its target and renamed
    when complete, then registered in the store with its parent and level.

    \b
    Examples:
      edgellm convert smollm2-135m-instruct --to f16
      edgellm quantize smollm2-135m-instruct-f16 --level q4_k_m
      edgellm quantize smollm2-135m-instruct-f16 -l q4_0 -l q8_0 --json
      edgellm quantize smollm2-135m-instruct-f16 -l q4_k_m -l iq2_xs --imatrix auto
      edgellm quantize smollm2-135m-instruct-f16 --budget 90MB --exclude-types q4_1
      edgellm quantize smollm2-135m-instruct-f16 --budget 4.5bpw --no-error-feedback
    """
    from quant.quantize import describe, quantize  # its worker is already starting (edgellm.cli: prestart)

    if error_feedback is not None and budget is None:
        raise UsageError("--error-feedback goes with --budget (a recipe made with it applies it itself)")
    if budget is not None or recipe_file is not None:
        if levels:
            raise UsageError("--budget and --recipe choose the types themselves; drop --level")
        if budget is not None and recipe_file is not None:
            raise UsageError("give exactly one of --budget SIZE or --recipe FILE")
        with running_job(not no_progress and not as_json) as (bar, token):
            job: dict[str, Any] = dict(
                imatrix=imatrix, output=output, threads=threads, force=force, on_progress=bar, cancel=token
            )
            if recipe_file is not None:
                from quant.recipe import apply_recipe  # not quant.budget: the search's imports cost ~0.3 s

                r, recipe = apply_recipe(model, recipe_file, **job)
            else:
                from quant.budget import quantize_to_budget  # numpy and the sensitivity probes: only for --budget

                r, recipe = quantize_to_budget(
                    model, budget=budget, exclude=exclude_types.split(","), feedback=error_feedback, **job
                )
        if as_json:
            emit_json(
                [
                    {
                        **r.to_json(),
                        "search_seconds": recipe.search_seconds,
                        "recipe_file": recipe.file,
                        "rounding": recipe.rounding,
                        "error_feedback": recipe.feedback,
                        "feedback_seconds": recipe.feedback_seconds,
                        "feedback_skipped": recipe.feedback_skipped,
                    }
                ]
            )
            return
        from quant.rounding import describe as rounding_text

        click.echo(describe(r))
        click.echo(f"  recipe: {recipe.file} (search {recipe.search_seconds:.1f} s, quantization {r.quantize_seconds:.1f} s)")
        click.echo(f"  rounding: {rounding_text(recipe.rounding)}")
        fs = recipe.feedback_seconds
        if recipe.feedback_skipped:
            click.echo(f"  error feedback: left out ({recipe.feedback_skipped}); the file is llama.cpp's rounding")
        elif recipe.feedback and not fs.get("passes"):
            click.echo(
                "  error feedback: none of this recipe's matrices is in a type it rewrites; the file is llama.cpp's rounding"
            )
        elif recipe.feedback:
            click.echo(
                f"  error feedback: {int(fs.get('matrices', 0))} matrices ("
                + (
                    "the calibration text alone: the model is too large to write tokens of its own"
                    if not fs.get("sequences")
                    else f"{int(fs['sequences'])} sequences of its own "
                    + ("read back from an earlier job" if fs.get("tokens_cached") else f"written {fs.get('tokens', 0):.1f} s")
                )
                + ", "
                f"inputs {fs.get('inputs', 0):.1f} s"
                + (f" in {int(fs['passes'])} passes" if fs.get("passes", 1) > 1 else "")
                + f", rewrite {fs.get('rewrite', 0):.1f} s)"
            )
        return
    wanted = [part.strip() for text in levels for part in text.split(",") if part.strip()]
    with running_job(not no_progress and not as_json) as (bar, token):
        results = quantize(
            model,
            wanted,
            output=output,
            threads=threads,
            jobs=jobs,
            allow_requantize=allow_requantize,
            force=force,
            imatrix=imatrix,
            on_progress=bar,
            cancel=token,
        )
    if as_json:
        emit_json([r.to_json() for r in results])
        return
    for r in results:
        click.echo(describe(r))


@click.command("convert")
@click.argument("model")
@click.option("--to", "to", default="f16", show_default=True, help="Float type to write: f16, bf16 or f32.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output file or folder (default: the store).")
@click.option("--name", help="Store name (default: the input's name with its level swapped, e.g. ...-f16).")
@_force_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def convert_cmd(model, to, output, name, force, as_json, no_progress) -> None:
    """Dequantize MODEL to F16/BF16/F32 with gguf-py, keeping all metadata.

    For models published only quantized: the result is a base that
    `edgellm quantize` and the quality evaluation can start from (its record
    notes which level it was dequantized from).

    \b
    Example:
      edgellm convert smollm2-135m-instruct --to f16
    """
    from quant.convert import convert  # gguf-py and numpy: only for `convert`

    with running_job(not no_progress and not as_json) as (bar, token):
        r = convert(model, to, output=output, name=name, force=force, on_progress=bar, cancel=token)
    if as_json:
        emit_json(r.to_json())
        return
    types = ", ".join(f"{k} {v}" for k, v in sorted(r.tensor_types.items(), key=lambda kv: -kv[1]))
    click.echo(
        f"{r.name}: {r.level} from {r.source_level}, {human_size(r.size_bytes)}, {r.bpw:.2f} bits/weight, {r.seconds:.1f} s"
    )
    click.echo(f"  {r.path}")
    click.echo(f"  tensors: {types}")
    for w in r.warnings:
        click.echo(f"note: {w}", err=True)


@click.command("imatrix")
@click.argument("model", required=False)
@click.option(
    "--text",
    "text",
    type=click.Path(path_type=Path),
    help="Calibration text (default: the text shipped with edgellm: prose, code and dialogue).",
)
@click.option("--ctx", type=int, default=512, show_default=True, help="Tokens per chunk (llama-imatrix's -c).")
@click.option("--chunks", type=int, help="Chunks to evaluate (default: all the text holds).")
@click.option("--name", help="Store name (default: <model>-imatrix).")
@click.option("--threads", type=int, help="Threads for llama.cpp (default: physical cores).")
@click.option(
    "--process-output/--no-process-output",
    default=True,
    show_default=True,
    help="Give the output layer (a tied one too) an entry; off: llama-imatrix's default file exactly.",
)
@click.option("--force", is_flag=True, help="Replace a stored matrix of the same name.")
@click.option("--list", "list_", is_flag=True, help="List the stored importance matrices.")
@click.option("--delete", "delete", metavar="NAME", help="Delete a stored importance matrix (its .gguf and .json).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def imatrix_cmd(model, text, ctx, chunks, name, threads, process_output, force, list_, delete, as_json, no_progress) -> None:
    """Compute MODEL's importance matrix, as llama-imatrix does, and store it.

    The matrix (mean squared activation entering each weight matrix) lets
    `quantize --imatrix` spend precision where the model uses it, and makes
    the IQ1/IQ2/IQ3_XXS/IQ3_XS/Q2_K_S levels possible. Written in
    llama-imatrix's GGUF format, so llama-quantize reads it too.

    \b
    Examples:
      edgellm imatrix smollm2-135m-instruct-f16
      edgellm imatrix smollm2-135m-instruct-f16 --text notes.txt --chunks 32 --json
      edgellm quantize smollm2-135m-instruct-f16 -l iq2_xs --imatrix auto
      edgellm imatrix --delete smollm2-135m-instruct-f16-imatrix
    """
    from quant.imatrix import compute_imatrix, delete_imatrix, describe, list_imatrices  # numpy: only for `imatrix`

    if delete:
        if model or list_:
            raise UsageError("--delete takes a matrix NAME only: no MODEL, no --list")
        rec = delete_imatrix(delete)
        if as_json:
            emit_json(rec.to_json())  # the record as it was, as `models rm --json` gives the removed models
        else:
            click.echo(f"deleted {rec.name}")
        return
    if list_:
        recs = list_imatrices()
        if as_json:
            emit_json([r.to_json() for r in recs])
        else:
            for r in recs:
                click.echo(describe(r))
        return
    if not model:
        raise UsageError("give a MODEL (store name or GGUF path), or --list or --delete NAME")
    with running_job(not no_progress and not as_json) as (bar, token):
        rec = compute_imatrix(
            model,
            text=text,
            ctx=ctx,
            chunks=chunks,
            name=name,
            force=force,
            threads=threads,
            output=process_output,
            on_progress=bar,
            cancel=token,
        )
    if as_json:
        emit_json(rec.to_json())
    else:
        click.echo(describe(rec))
