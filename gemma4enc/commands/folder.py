"""The commands on an output folder: inspect, verify (and --repair), compact, export, search."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .quick import echo

from ..errors import UsageError
from ..options import Options, parse_size
from ..output.opening import open_out, reading
from .app import command
from .flags import Json, OutFolder, Quiet


@command()
def inspect(out: OutFolder, json_out: Json = False):
    """Summarise an output folder: files by status, shards, tokens, failures."""
    from .report import inspect_report

    with reading(out) as o:
        report = inspect_report(o) | {"out": str(out)}
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        echo("\n".join(report_lines(report)))  # names escaped on a terminal


@command()
def verify(
    out: OutFolder,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Encode again the files of shards that are missing or fail a check (with the settings OUT records).",
        ),
    ] = False,
    json_out: Json = False,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="Print only the problems, nothing when OUT is sound: the exit code says."),
    ] = False,
):
    """Check every shard against the manifest: counts, offsets, dtype, finite values; orphans, missing."""
    from .report import verify as check

    with reading(out) as o:
        report = check(o) | {"out": str(out)}
    if repair and report["bad_shards"]:
        repaired = _repair(out, report["bad_shards"])
        with reading(out) as o:
            report = check(o) | {"out": str(out), "repaired": repaired}
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        if not quiet:
            echo(f"{report['out']}: {report['files']} files, {report['encoded']} encoded in {report['shards']} "
                 f"shards, {report['tokens_checked']:,} tokens checked")
        for line in report["problems"]:
            echo(f"problem: {line}")
        for line in [] if quiet else report["warnings"]:
            echo(f"warning: {line}")
        if not quiet:
            echo("ok" if report["ok"] else f"{len(report['problems'])} problem(s)")
    raise typer.Exit(0 if report["ok"] else 1)


def _repair(out: str, shards: list[str]) -> int:
    """Supersede the rows into these shards, then encode their files again (with the settings OUT
    records, through the same function as encode); returns how many were asked for."""

    from ..media.sources import exists
    from ..output.repair import LOST, mark_lost
    from ..run.encode import encode as run_encode

    with open_out(out, write=True) as o, o.locked():
        ledger = o.ledger()
        mark_lost(o, set(shards), ledger)
        o.sync()
        lost = [(p, e.root) for p, e in ledger.entries() if e.status == LOST]
    # each file under the root its row records: its new row keeps `root` and `rel` (a moved
    # folder is still recognised, exports say where it sat); a gone input keeps its lost row
    found = [(p, root, _rel(p, root)) for p, root in lost if exists(p)]
    if found:
        run_encode(None, out, found=found)  # its rows say how each file went; the second verify tells
    return len(lost)


def _rel(path: str, root: str | None) -> str | None:
    return path[len(root) :].lstrip("/") if root else None


@command()
def compact(
    out: OutFolder,
    prune: Annotated[
        bool,
        typer.Option("--prune", help="Also drop the rows and tokens of inputs that no longer exist."),
    ] = False,
    json_out: Json = False,
):
    """Rewrite the manifest with one row per file (the latest), under OUT's lock."""
    with open_out(out, write=True) as o, o.locked(need=True):
        report = o.compact(prune=prune) | {"out": str(out)}  # OUT as named (a store's: its new base)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(
            f"{report['out']}: {report['rows_before']} rows → {report['rows_after']}; pruned "
            f"{report['pruned']} file(s), {report['pruned_tokens']:,} tokens, {report['shards_rewritten']} "
            "shard(s) rewritten"
        )


@command()
def export(
    out: OutFolder,
    dest: Annotated[str, typer.Argument(help="Folder to write (new or empty; see --overwrite).")],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="clip (img_emb/*.npy + metadata/*.parquet, pooled vectors: embedding-reader, autofaiss), parquet (one row per file with its tokens: datasets, pyarrow, DuckDB), webdataset (tar shards of KEY.npy + KEY.json), lance (a Lance table: LanceDB, the Hub; a later export appends what is new) or vllm (KEY/encoder_cache.safetensors + index.jsonl: vLLM's encoder cache).",
        ),
    ] = "clip",
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            help="float16 or float32 (bfloat16 tokens widen to float32 exactly); --to vllm: the engine's "
            "dtype, float32, bfloat16 or float16. Default: float16, float32 for vllm.",
            show_default=False,
        ),
    ] = None,
    per_frame: Annotated[
        bool,
        typer.Option(
            "--per-frame",
            help="One row per sampled video frame (its tokens and their mean) instead of per file.",
        ),
    ] = False,
    normalize: Annotated[
        Optional[bool],
        typer.Option(
            "--normalize/--no-normalize",
            help="L2-normalise the pooled vectors (default: on for clip, off otherwise).",
            show_default=False,
        ),
    ] = None,
    rows_per_file: Annotated[
        Optional[int],
        typer.Option(
            "--rows-per-file",
            help="Start a new file after this many rows (default: by --file-size only).",
        ),
    ] = None,
    file_size: Annotated[
        str,
        typer.Option(
            "--file-size",
            help="Start a new file once this many bytes of vectors or tokens are written: 1GB, 256MB, 1GiB.",
        ),
    ] = "1GB",
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an earlier export in the folder (only the files an export writes are removed).",
        ),
    ] = False,
    json_out: Json = False,
):
    """Export the latest ok row of every file to another tool's format, streamed shard by shard."""
    from ..media.remote import is_url
    from ..output.export import export_to

    if to == "vllm":  # read by byte range, a URL OUT included: no local mirror of it
        from ..serving.export import export_vllm

        report = export_vllm(str(out), dest, dtype or "float32", overwrite)
        if json_out:
            typer.echo(json.dumps(report, indent=2))
        else:
            hashless = report["unkeyed"] - report["changed"]
            unkeyed = f"; {hashless} without a content hash left out (encode --hash)" if hashless else ""
            changed = (f"; {report['changed']} changed or gone since their encode left out (encode again)"
                       if report["changed"] else "")
            typer.echo(f"{report['dir']}: {report['rows']:,} files, vllm, {report['dtype']}{unkeyed}{changed}")
        for warning in report["warnings"]:
            echo(f"gemma4enc: warning: {warning}", err=True)
        return
    dtype = dtype or "float16"

    dest = dest if is_url(dest) else Path(dest)  # a URL: made here, then uploaded
    with reading(out) as o:
        report = export_to(
            o,
            to,
            dest,
            dtype,
            per_frame,
            normalize,
            rows_per_file,
            parse_size(file_size, "--file-size"),
            overwrite=overwrite,
        )
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    elif to == "lance":
        typer.echo(
            f"{report['dir']}: {report['rows']:,} rows (version {report['version']}: {report['added']:,} added, "
            f"{report['deleted']:,} deleted), lance, {dtype}{', normalised' if report['normalized'] else ''}"
            f"{', per frame' if per_frame else ''}"
        )
    else:
        typer.echo(
            f"{report['dir']}: {report['rows']:,} rows in {len(report['files'])} file(s), {to}, {dtype}"
            f"{', normalised' if report['normalized'] else ''}{', per frame' if per_frame else ''}"
        )


def _write_stdout(data: bytes) -> None:
    import sys

    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@command()
def search(
    out: OutFolder,
    files: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Files (or folders of them) to find the nearest of: looked up in OUT, or encoded with "
            "OUT's settings and model.",
            show_default=False,
        ),
    ] = None,
    files_from: Annotated[
        Optional[str],
        typer.Option("--files-from", help="Also the files (or folders) listed in this file, one a line; - for stdin."),
    ] = None,
    k: Annotated[
        int,
        typer.Option(
            "-k", "--top", help="Nearest files listed per file (itself first, when OUT holds it)."
        ),
    ] = 10,
    dups: Annotated[
        bool,
        typer.Option("--duplicates", help="Instead: the groups of near-duplicate files in OUT."),
    ] = False,
    threshold: Annotated[
        float,
        typer.Option(
            "--threshold", help="--duplicates: the cosine two files' pooled vectors reach to be grouped."
        ),
    ] = 0.98,
    keep: Annotated[
        str,
        typer.Option("--keep", help="--duplicates: which file of a group is kept: first (in OUT), largest, "
                     "smallest, newest, oldest, central (most like the rest) or random."),
    ] = "first",
    groups_to: Annotated[
        Optional[Path],
        typer.Option("--groups", help="--duplicates: write the groups here, as .jsonl or .parquet."),
    ] = None,
    drop_list: Annotated[
        Optional[str],
        typer.Option("--drop-list", help="--duplicates: write the paths to drop here, one a line, or NUL-ended "
                     "with -0 (- for stdout): only files unchanged since their encode whose kept file is too."),
    ] = None,
    move_dropped: Annotated[
        Optional[Path],
        typer.Option("--move-dropped", help="--duplicates: move the files to drop into this folder (their "
                     "absolute paths kept below it), each checked again just before; --undo-moves puts them back."),
    ] = None,
    undo_moves: Annotated[
        Optional[Path],
        typer.Option("--undo-moves", help="Put back every file an earlier --move-dropped moved into this folder."),
    ] = None,
    null: Annotated[
        bool,
        typer.Option("--null", "-0", help="NUL-separated: --files-from's names, and every list written "
                     "(--drop-list, the groups' members)."),
    ] = False,
    method: Annotated[
        str,
        typer.Option("--method", help="--duplicates: exact (every pair), partitioned (k-means, then exact "
                     "inside each partition) or auto (exact while it is small)."),
    ] = "auto",
    engine: Annotated[
        str, typer.Option("--engine", help="--duplicates: where partitions are compared: local, or ray.")
    ] = "local",
    ray_address: Annotated[
        Optional[str], typer.Option("--ray-address", help="--engine ray: a running cluster (auto or HOST:PORT); "
                                    "default: a private Ray on this machine.")
    ] = None,
    device: Annotated[
        str, typer.Option(help="Where files OUT lacks are encoded: auto, cpu, cuda, cuda:N or mps.")
    ] = "auto",
    json_out: Json = False,
    quiet: Quiet = False,
):
    """Nearest files by cosine of pooled vectors (an index cached in OUT), or groups of near-duplicates."""
    from ..run import drop
    from ..run.dedup import write_groups
    from ..run.search import duplicates, query_files
    from .quick import answer

    say = (lambda m: None) if quiet else (lambda m: echo(f"gemma4enc: {m}", err=True))
    if undo_moves is not None:
        report = drop.undo(undo_moves, say)
        typer.echo(json.dumps(report, indent=2) if json_out else f"{report['put_back']} file(s) put back")
        return
    wanted = query_files(files, files_from, null) if (files or files_from) else []
    if dups == bool(files or files_from):
        raise UsageError("give FILES (or --files-from) to search for, or --duplicates (not both)")
    if dups:
        if drop_list not in (None, "-") and not Path(drop_list).parent.is_dir():
            raise UsageError(f"--drop-list {drop_list}: no folder {Path(drop_list).parent}")
        with reading(out) as o:
            report = duplicates(o, threshold, log=say, method=method, keep=keep, engine=engine,
                                ray_address=ray_address) | {"out": str(out)}
        if groups_to is not None:
            write_groups(groups_to, report["groups"])
        drops, left = drop.standing(report)  # checked against the disk now: see run/drop.py
        report.pop("seen")
        if left:
            say(f"{left} file(s) of the groups are left out of what is dropped: not unchanged files on this "
                "disk (inside a tar, at a URL, or changed since the groups were made), or their kept file is not")
        if drop_list is not None:
            listed = drop.list_bytes([d.path for d in drops], null)
            if drop_list == "-":
                _write_stdout(listed)
            else:
                try:
                    Path(drop_list).write_bytes(listed)
                except OSError as e:
                    raise UsageError(f"--drop-list {drop_list}: {e.strerror or e}") from None
        if move_dropped is not None:
            report["moves"] = drop.move(drops, move_dropped, say)
        if json_out:
            typer.echo(json.dumps(report, indent=2))
        elif drop_list != "-":
            if null:  # each member NUL-ended, and each group too
                _write_stdout(b"".join(drop.list_bytes(g["members"], True) + b"\0" for g in report["groups"]))
            else:  # a line a member, a blank line between groups; a name with a newline is refused
                _write_stdout(b"\n".join(drop.list_bytes(g["members"], False) for g in report["groups"]))
        say(f"{len(report['groups'])} group(s) of {sum(g['size'] for g in report['groups'])} files at cosine "
            f"≥ {threshold} ({report['method']}); {len(drops)} to drop"
            + (f", {report['moves']['moved']} moved to {move_dropped}" if move_dropped is not None else ""))
        return
    Options(device=device)  # a bad --device is refused before the index is read
    raise typer.Exit(answer(out, wanted, k, device, json_out, quiet))
