"""An output folder in the formats other tools read as they are (`gemma4enc export OUT --to … DIR`).

  clip        img_emb/img_emb_N.npy + metadata/metadata_N.parquet, row-aligned: clip-retrieval's
              layout, what embedding-reader (parquet_npy) and autofaiss read; pooled vectors,
              L2-normalised by default
  parquet     data/train-NNNNN.parquet (the Hub's layout: export.json is no split), one row per file:
              the metadata, `soft_tokens` (n, D) as datasets'
              Array2D((None, D)) stores it, `pooled` as a fixed-size list; datasets, pyarrow, DuckDB
  webdataset  NNNNNN.tar: KEY.npy (tokens), KEY.pooled.npy, KEY.json (the row) per sample; the key is
              a row number (WebDataset's key ends at the first dot of a name, so it has none)
  lance       a Lance table (LanceDB's): the metadata, `vector` (pooled) and `soft_tokens`; a second
              export goes on from the first as a new version (tolance.py)

Rows are vectors.records(): the latest ok row of each file, shard after shard. Files are written
one at a time under temporary names and renamed when whole; a file is closed at --rows-per-file
rows or --file-size bytes, so memory holds one shard's rows and one batch, never the folder.
Arrow, Parquet and numpy have no bfloat16: values leave as float16 or float32 (float32 holds
bfloat16 exactly), and the choice is recorded with the run's settings in every file and export.json.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np

from .._version import __version__
from ..errors import OutputError, UsageError, reason
from .files import atomic_write
from .formats import WRITERS, row_meta
from .vectors import hidden_size, placed, records

FORMATS = ("clip", "parquet", "webdataset", "lance", "vllm")  # vllm: serving/export.py, by the command
DTYPES = ("float16", "float32")  # what Arrow, Parquet and numpy hold (no bfloat16); np.dtype(name)
INFO = "export.json"
# what an export writes, and only that (--overwrite removes these)
OURS = re.compile(
    r"^(img_emb/img_emb_\d+\.npy|metadata/metadata_\d+\.parquet|data/train-\d+\.parquet|\d{6}\.tar|"
    + re.escape(INFO)
    + r")$"
)


def export(
    out,
    to: str,
    dest,
    dtype: str = "float16",
    per_frame: bool = False,
    normalize: bool | None = None,
    rows_per_file: int | None = None,
    file_bytes: int = 10**9,
    overwrite: bool = False,
) -> dict:
    """Write OUT's latest ok rows to DEST in format `to`; returns the summary --json prints."""
    from .npreader import NumpyEmbeddings

    if to not in FORMATS or to == "vllm":
        raise UsageError(f"--to {to!r}: use one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise UsageError(
            f"--dtype {dtype!r}: use float16 or float32 (Arrow, Parquet and numpy have no bfloat16)"
        )
    if rows_per_file is not None and rows_per_file < 1:
        raise UsageError(f"--rows-per-file {rows_per_file}: must be at least 1")
    try:
        pa = __import__("pyarrow")
        __import__("pyarrow.parquet")
    except ImportError:
        raise UsageError("export needs pyarrow: pip install 'gemma4enc[export]'") from None
    try:
        emb = NumpyEmbeddings(out)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if to != "lance":
        dest = Path(dest)
        _clear(dest, overwrite)
    start = time.perf_counter()
    shards = placed(emb)
    normalize = to == "clip" if normalize is None else normalize
    info = {
        "producer": f"gemma4enc {__version__}",
        "source": _source(emb.out),
        "format": to,
        "dtype": dtype,
        "normalized": normalize,
        "per_frame": per_frame,
        "hidden_size": hidden_size(emb, shards),
        "settings": emb.out.settings() or {},
    }
    if to == "lance":  # a versioned table Lance writes itself (a folder or a URL): tolance.py
        from .tolance import export_lance

        return info | {"dir": str(dest)} | export_lance(emb, str(dest), info, shards, overwrite)
    writer = WRITERS[to](dest, info, pa, rows_per_file or (1 << 62), file_bytes)
    rows = 0
    try:
        for rec in records(emb, per_frame, tokens=to != "clip", shards=shards):
            if normalize:
                norm = float(np.linalg.norm(rec.pooled))
                rec.pooled = rec.pooled / norm if norm > 0 else rec.pooled
            writer.add(rec, row_meta(rec, per_frame))
            rows += 1
        files = writer.close()
        report = info | {"dir": str(dest), "rows": rows, "files": files}
        atomic_write(dest / INFO, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    except OSError as e:
        writer.abort()
        raise OutputError(
            f"cannot write the export in {dest}: {reason(e)}; run it again with --overwrite "
            "once the folder takes writes"
        ) from None
    except BaseException:
        writer.abort()
        raise
    return report | {"seconds": round(time.perf_counter() - start, 3)}


def export_to(out, to: str, dest, *args, overwrite: bool = False) -> dict:
    """export() into DEST, a folder or a URL (s3://bucket/prefix): to a store, the export is made
    in a temp folder here (the disk holds it whole), then each file is uploaded, export.json last
    (an export that stops on the way has none, as locally)."""
    import shutil
    import tempfile

    from ..media.remote import is_url
    from .store import SAVED, Store

    if not is_url(str(dest)) or to == "lance":  # Lance writes to a store itself
        return export(out, to, dest, *args, overwrite=overwrite)  # type: ignore[misc]  # args: export's, up to file_bytes
    store = Store(str(dest))
    try:
        there = store.find_all("list DIR")
    except OutputError as e:  # keys, endpoint: nothing written yet
        raise UsageError(str(e).removesuffix(SAVED)) from None
    if there and not overwrite:
        raise UsageError(
            f"{store.url} is not empty; give another prefix, or --overwrite to replace an earlier export"
        )
    store.delete(sorted(n for n in there if OURS.match(n)))
    local = Path(tempfile.mkdtemp(prefix="gemma4enc-export-"))
    try:
        report = export(out, to, local / "dest", *args, overwrite=False)  # type: ignore[misc]
        for name in [*report["files"], INFO]:
            store.upload(local / "dest" / name, name)
    except OutputError as e:
        raise OutputError(
            str(e).removesuffix(SAVED).replace(str(local / "dest"), store.url)
            + "; run it again with --overwrite once the store takes writes"
        ) from None
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return report | {"dir": store.url}


def _source(out) -> str:
    """OUT as the user named it: a store's URL (not its working copy), a folder's absolute path."""
    return out.absolute()


def _clear(dest: Path, overwrite: bool) -> None:
    """DEST made; one that holds anything is refused, or with --overwrite loses what an export wrote."""
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest}: not a folder")
    found = sorted(p for p in dest.rglob("*") if p.is_file()) if dest.is_dir() else []
    if found and not overwrite:
        raise UsageError(
            f"{dest} is not empty; give another folder, or --overwrite to replace an earlier export"
        )
    for p in found:
        if OURS.match(p.relative_to(dest).as_posix()):
            p.unlink()
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write to {dest}: {e.strerror or e}") from None


# ── rows ─────────────────────────────────────────────────────────────────────────────────────────


# ── files ────────────────────────────────────────────────────────────────────────────────────────
