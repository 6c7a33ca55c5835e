"""`pagecli models`: which models are ready to run, and preparing the embedded default."""

from __future__ import annotations

from typing import Annotated

import typer

from pagecli.cli.app import app
from pagecli.ui.progress import say


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def models(
    ctx: typer.Context,
    prepare: Annotated[bool, typer.Option("--prepare", help="Convert the embedded default model now "
                                                           "(install.sh runs this), so the first run does not wait.")] = False,
) -> None:
    """List the embedded default model and the models converted into pagecli's cache; `--lora NAME=PATH`
    (repeatable) also describes LoRA adapter folders: rank, alpha, targets, size."""
    from pagecli.models import source
    from pagecli.paths import models_dir

    # --lora is read from the extra arguments: Typer coerces every declared non-bool option through pydantic,
    # which `pagecli models` must not import (tests/test_startup_imports.py).
    adapters = _lora_values(list(ctx.args))
    if prepare:
        folder = source.prepare_default_model(progress=lambda msg: say(msg, style="dim"))
        typer.echo(f"Default model ready: {folder}")
        return
    from pagecli.models import gguf_files

    state = "ready" if source.is_default_model_prepared() else "not converted yet (first run converts it)"
    typer.echo(f"default      {source.DEFAULT_MODEL_NAME} (embedded): {state}")
    default_folder = source.converted_folder_for(source.default_model_gguf())
    typer.echo(f"             weights: {_weights_path(source.default_model_gguf(), default_folder)}")
    root = models_dir()
    for folder in sorted(p for p in root.glob("*") if p.is_dir() and (p / "config.json").is_file()):
        # the whole folder: a GGUF model's quantized weights stay in its file, so its safetensors are a few norms
        size_mb = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
        typer.echo(f"converted    {folder.name}  {size_mb:,.1f} MB  {folder}")
        gguf = gguf_files.gguf_source(folder)
        if gguf is not None:
            typer.echo(f"             weights: {_weights_path(gguf, folder)}")
    typer.echo("Any local Hugging Face folder, .gguf file or hub id also works: pagecli chat -m MODEL")
    typer.echo(_architectures())
    if adapters:
        _describe_adapters(adapters)


def _lora_values(args: list[str]) -> list[str]:
    """The NAME=PATH values of `--lora NAME=PATH` / `--lora=NAME=PATH`; anything else is one sentence."""
    from pagecli.errors import PagecliError

    values = []
    while args:
        arg = args.pop(0)
        if arg == "--lora" and args:
            values.append(args.pop(0))
        elif arg.startswith("--lora="):
            values.append(arg.removeprefix("--lora="))
        else:
            raise PagecliError(f"`pagecli models` takes --prepare and --lora NAME=PATH; '{arg}' is neither.")
    return values


def _describe_adapters(values: list[str]) -> None:
    """Each --lora adapter in one line (a running server lists its own at GET /v1/models)."""
    from pagecli.cli.options import lora_pairs
    from pagecli.models.lora import describe_folder

    for name, path in lora_pairs(values):
        typer.echo(f"lora         {describe_folder(name, path)}")


def _architectures() -> str:
    """The architectures pagecli runs, and the GGUF files it converts (without torch or numpy)."""
    from pagecli.models.spec import SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_NAMES

    return f"Architectures: {SUPPORTED_NAMES}. GGUF files of: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}."


def _weights_path(gguf_path, folder) -> str:
    """Which path a GGUF file's decoder weights take by default here, and which run as they are with --quantize gguf."""
    from pagecli.errors import ModelError
    from pagecli.models import gguf_files
    from pagecli.native import cpu_has_bf16

    here = ("floats (dequantized from the file as it loads) by default here (bfloat16; --quantize auto runs the "
            "blocks in float32 runs)" if cpu_has_bf16() else "the blocks by default here (float32: --quantize auto; none: their floats)")
    if not folder.is_dir():  # no index yet: parsing the file's header takes seconds, conversion writes one
        return f"{here}; which run as they lie is listed once it is converted (pagecli models --prepare)"
    try:
        return f"{here}; {gguf_files.describe_path(gguf_path, folder)}"
    except (ModelError, OSError) as error:
        return f"unreadable ({error})"
