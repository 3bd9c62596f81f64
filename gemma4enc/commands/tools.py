"""The tool commands: bench (and bench --e2e) and fetch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .quick import echo

from ..errors import UsageError
from .app import command
from .flags import Device, Dtype, Json, MaxPatches, Workers, local_path


@command()
def bench(
    folder: Annotated[
        Optional[str],
        typer.Argument(
            help="--e2e: measure a sample of this folder instead of the generated real-size set.",
            show_default=False,
        ),
    ] = None,
    size: Annotated[
        str,
        typer.Option(
            help="Released tower size to imitate: e2b, 26b or 12b (the unified model's embedder; random weights)."
        ),
    ] = "e2b",
    layers: Annotated[
        Optional[int], typer.Option(help="Use only N encoder layers (to fit a CPU's time).")
    ] = None,
    workload: Annotated[
        Optional[list[str]], typer.Option(help="photos, video or mixed (repeatable).")
    ] = None,
    items: Annotated[
        int,
        typer.Option(
            help="Items per workload (video: clips of 32 frames); --e2e DIR: files sampled per kind."
        ),
    ] = 24,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds; medians are reported.")] = 3,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_batch_patches: MaxPatches = None,
    use_compile: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Add `compiled`: serial through the torch.compile'd layers (compile time reported apart).",
        ),
    ] = False,
    e2e: Annotated[
        bool,
        typer.Option(
            "--e2e",
            help="Instead: real-size media (generated once and cached, or a sample of FOLDER) per kind: decode rate per core, peak RSS per worker, cores that keep the tower fed; then decode workers → tower → shards and their overlap.",
        ),
    ] = False,
    tower_rate: Annotated[
        Optional[float],
        typer.Option(
            help="--e2e: photos/s at 280 tokens the tower takes (e.g. your GPU's), instead of the rate measured here.",
            min=0.001,
        ),
    ] = None,
    workers: Workers = None,
    json_path: Annotated[
        Optional[str], typer.Option("--json", metavar="<path>", help="Also write the report as JSON here.")
    ] = None,
):
    """Benchmark hf-padded, serial, bucket and pack side by side (items/s, patches/s, memory, MFU)."""
    folder, json_path = local_path(folder, "bench's FOLDER"), local_path(json_path, "--json")
    if folder is not None and not e2e:
        raise UsageError("a FOLDER is measured only with --e2e")
    if folder is not None and not folder.is_dir():
        raise UsageError(f"{folder}: not a folder")
    if e2e:
        from ..dev.e2e import e2e as run_e2e

        report = run_e2e(
            size,
            layers,
            device,
            dtype,
            items,
            workers,
            repeats,
            folder,
            tower_rate,
            log=lambda s: typer.echo(s),
        )
    else:
        from ..dev.bench import bench as run_bench

        report = run_bench(
            size,
            layers,
            device,
            dtype,
            tuple(workload or ["photos"]),
            items,
            repeats,
            max_batch_patches,
            use_compile,
            log=lambda s: typer.echo(s),
        )
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))


@command()
def fetch(
    model: Annotated[str, typer.Argument(help="Hub id (org/name).")],
    revision: Annotated[
        Optional[str], typer.Option(help="Branch, tag or commit (default: main).")
    ] = None,
    json_out: Json = False,
):
    """Fetch a hub checkpoint's config and vision tensors only (HTTP range requests) into the cache, so
    that encode --model MODEL runs offline (HF_HUB_OFFLINE=1) here or wherever the cache is copied."""
    from ..model.hub import fetch as fetch_vision

    if model.count("/") != 1 or model.startswith((".", "/", "~")) or Path(model).expanduser().exists():
        raise UsageError(f"{model}: not a hub id like 'org/name' (a local folder needs no fetch)")
    report = fetch_vision(model, revision, log=lambda m: echo(f"gemma4enc: {m}", err=True), fetching=True)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
        return
    how = (
        "already cached, nothing fetched"
        if report["cached"]
        else f"{report['bytes_fetched']:,} bytes fetched"
    )
    tensors = f"{report['tensors']} vision tensors, " if "tensors" in report else ""
    typer.echo(f"{model}@{report['commit']}: {tensors}{how}")
    if report.get("files_skipped"):
        typer.echo(f"skipped (no vision tensor): {', '.join(report['files_skipped'])}")
    if report.get("source_bytes"):
        typer.echo(
            f"of {report['source_bytes']:,} bytes in {len(report['source_files'])} file(s) holding vision tensors"
        )
    typer.echo(f"folder: {report['folder']}")
