"""`export --to lance`: OUT as a Lance table, what LanceDB opens and the Hugging Face Hub reads.

One row per file (or per sampled frame with --per-frame):
  the metadata columns every export carries (formats.META: path, rel, kind, frames, tokens, width,
  height, size, mtime_ns, sha256, caption, url, sidecar; with --per-frame also frame, frame_index,
  timestamp);
  vector       fixed_size_list<float16|float32>[D]: the pooled vector (LanceDB's default vector
               column, so `table.search(v)` needs no column name);
  soft_tokens  list<fixed_size_list<…>[D]>: the file's (n, D) soft tokens, one list item a token
               (not for an OUT encoded with --store pooled, which keeps none).
The run's settings and the export's own (dtype, normalised, per frame, width) are the schema's
metadata under `gemma4enc`.

An export into a table an earlier export made goes on from it as a new Lance version instead of
rewriting it: rows of files OUT no longer holds as they were (changed, gone, pruned) are deleted,
and OUT's rows the table lacks are appended; a table made with other settings is refused (use
--overwrite). A row is "the same" when its path, size, mtime_ns (and frame) are.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ..errors import UsageError
from .formats import cast, columns_of, row_meta
from .vectors import records

BATCH_ROWS = 1024  # rows handed to Lance at once (memory: their tokens)
KEY = ("path", "size", "mtime_ns")  # what makes a row the same file as exported before
SAME = ("format", "dtype", "normalized", "per_frame", "hidden_size", "settings")  # what an append must share


def export_lance(emb, dest: str, info: dict, shards, overwrite: bool) -> dict:
    """Write (or bring up to date) the Lance table at DEST; returns rows, added, deleted, version."""
    try:
        import lance
        import pyarrow as pa
    except ImportError:
        raise UsageError("--to lance needs pylance: pip install 'gemma4enc[lance]'") from None
    start = time.perf_counter()
    schema = _schema(pa, info)
    store = storage_options(dest)
    before = None if overwrite else _existing(lance, dest, store)
    if before is not None:
        _same_settings(before, info, dest)
    key = KEY + (("frame",) if info["per_frame"] else ())
    have = set() if before is None else _keys(before, key)
    now: set[tuple] = set()

    def batches():
        rows = []
        for rec in records(emb, info["per_frame"], tokens=_tokens(info), shards=shards):
            if info["normalized"]:
                norm = float(np.linalg.norm(rec.pooled))
                rec.pooled = rec.pooled / norm if norm > 0 else rec.pooled
            meta = row_meta(rec, info["per_frame"])
            k = tuple(meta[c] for c in key)
            now.add(k)
            if k in have:
                continue  # in the table already, as it is
            rows.append((meta, rec))
            if len(rows) >= BATCH_ROWS:
                yield _batch(pa, schema, info, rows)
                rows = []
        if rows:
            yield _batch(pa, schema, info, rows)

    mode = "overwrite" if overwrite else "create" if before is None else "append"
    counted = {"rows": 0}

    def counting():
        for b in batches():
            counted["rows"] += b.num_rows
            yield b

    stream = counting()
    first = next(stream, None)
    if first is not None or before is None:
        try:
            lance.write_dataset(pa.RecordBatchReader.from_batches(schema, _chain(first, stream)), dest,
                                schema=schema, mode=mode, storage_options=store)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot write the Lance table {dest}: {str(e).splitlines()[0]}") from None
    else:
        for _ in stream:  # nothing new: still read OUT through, to know what is gone
            pass
    added = counted["rows"]
    deleted = 0
    table = lance.dataset(dest, storage_options=store)
    gone = have - now
    if gone:  # after the append: a failure in between leaves a row twice, never none
        deleted = _delete(table, key, gone)
        table = lance.dataset(dest, storage_options=store)
    return {"rows": table.count_rows(), "added": added, "deleted": deleted, "version": table.version,
            "files": [], "seconds": round(time.perf_counter() - start, 3)}


def _schema(pa, info: dict):
    value = pa.float16() if info["dtype"] == "float16" else pa.float32()
    dim = info["hidden_size"]
    fields = [(name, getattr(pa, kind)()) for name, kind in columns_of(info["per_frame"]).items()]
    fields += [("vector", pa.list_(value, dim))]
    if _tokens(info):
        fields += [("soft_tokens", pa.list_(pa.list_(value, dim)))]
    return pa.schema(fields, metadata={"gemma4enc": json.dumps(info)})


def _tokens(info: dict) -> bool:
    """Whether OUT keeps tokens (an OUT encoded with --store pooled keeps only the vectors)."""
    return (info.get("settings") or {}).get("store") != "pooled"


def _batch(pa, schema, info: dict, rows: list):
    dim, dtype = info["hidden_size"], info["dtype"]
    metas = [m for m, _ in rows]
    columns = [pa.array([m[f.name] for m in metas], type=f.type) for f in schema if f.name not in ("vector", "soft_tokens")]
    pooled = cast(np.stack([r.pooled for _, r in rows]), dtype)
    vector = pa.FixedSizeListArray.from_arrays(pa.array(pooled.ravel()), dim)
    if not _tokens(info):
        return pa.RecordBatch.from_arrays([*columns, vector], schema=schema)
    tokens = [cast(r.tokens, dtype) for _, r in rows]
    flat = np.concatenate(tokens) if tokens else np.zeros((0, dim), dtype)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), dim)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int32)
    soft = pa.ListArray.from_arrays(pa.array(offsets), inner)
    return pa.RecordBatch.from_arrays([*columns, vector, soft], schema=schema)


def _chain(first, rest):
    if first is not None:
        yield first
    yield from rest


# an object store that does not answer: each request bounded, a few retries, then one line (Lance's
# own defaults retry for minutes, and an http:// endpoint it was not told to allow hung the export)
BOUNDS = {"connect_timeout": "10s", "timeout": "120s", "client_max_retries": "3", "client_retry_timeout": "60"}


def storage_options(dest: str) -> dict | None:
    """Lance's storage options for an s3:// DEST, from the AWS_* variables gemma4enc's other store
    access (s3fs) reads: the endpoint (AWS_ENDPOINT_URL[_S3]), allowed over http:// where it is one,
    the region, and the keys where they are set. Passed in this process only: never stored or shown."""
    if not dest.startswith("s3://"):
        return None
    env = os.environ
    found = dict(BOUNDS)
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        found["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            found["allow_http"] = "true"
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        found["region"] = region
    for var, option in (("AWS_ACCESS_KEY_ID", "aws_access_key_id"), ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key"),
                        ("AWS_SESSION_TOKEN", "aws_session_token")):
        if env.get(var):
            found[option] = env[var]
    return found


def _existing(lance, dest: str, store: dict | None = None):
    """The Lance table at DEST, or None where there is none yet."""
    try:
        return lance.dataset(dest, storage_options=store)
    except (ValueError, OSError, FileNotFoundError):
        return None


def _same_settings(table, info: dict, dest: str) -> None:
    raw = (table.schema.metadata or {}).get(b"gemma4enc")
    theirs = json.loads(raw) if raw else {}
    differ = [k for k in SAME if theirs.get(k) != info.get(k)]
    if differ:
        raise UsageError(
            f"{dest} holds a table exported with other settings ({', '.join(differ)}); "
            "--overwrite replaces it, or give another DEST"
        )


def _keys(table, key: tuple) -> set[tuple]:
    got = table.to_table(columns=list(key))
    columns = [got.column(c).to_pylist() for c in key]
    return set(zip(*columns))


def _delete(table, key: tuple, gone: set[tuple]) -> int:
    """Rows whose key is in `gone` deleted, a few hundred a predicate (SQL string literals escaped)."""
    clauses = []
    for k in gone:
        parts = []
        for name, value in zip(key, k):
            if value is None:
                parts.append(f"{name} IS NULL")
            elif isinstance(value, str):
                parts.append(f"{name} = '" + value.replace("'", "''") + "'")
            else:
                parts.append(f"{name} = {int(value)}")
        clauses.append("(" + " AND ".join(parts) + ")")
    for lo in range(0, len(clauses), 256):
        table.delete(" OR ".join(clauses[lo:lo + 256]))
    return len(gone)
