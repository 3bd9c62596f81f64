"""`gemma4enc export OUT DIR --to vllm`: vLLM's encoder-cache layout, for its ECExampleConnector.

  DIR/<key>/encoder_cache.safetensors   one tensor, `ec_cache`: (tokens, text width) in --dtype; a
                                        video's frames one after another, as vLLM's embed_multimodal
                                        gives a video
  DIR/index.jsonl                       one row per file: path, key, kind, tokens, width, height,
                                        and a video's frames, frame_indices, fps (what the request
                                        helper sizes its stand-in media from)
  DIR/export.json                       the run: source, dtype, settings, counts

The key is cache.py's (content hash + the settings that shape a file's tokens), so a re-run, another
machine, or the connector serving OUT directly name every file the same. Files are written under
a temporary name and renamed; OUT (local or a URL) is only read, shard rows by byte range.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .._version import __version__
from ..errors import OutputError, UsageError, reason
from ..output.files import umask
from ..output.names import temp_name
from .cache import CACHE_FILE, KEY_RE, TENSOR, OutCache

DTYPES = ("float32", "bfloat16", "float16")
INDEX, INFO = "index.jsonl", "export.json"
ROW_FIELDS = ("kind", "tokens", "width", "height", "frames", "frame_tokens", "frame_indices", "timestamps",
              "fps", "duration", "total_frames", "sha256")


def _ours(dest: Path, p: Path) -> bool:
    rel = p.relative_to(dest).parts
    return (len(rel) == 1 and rel[0] in (INDEX, INFO)) or (len(rel) == 2 and KEY_RE.match(rel[0])
                                                            and rel[1] == CACHE_FILE)


def _clear(dest: Path, overwrite: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest}: not a folder")
    found = sorted(p for p in dest.rglob("*") if p.is_file()) if dest.is_dir() else []
    if found and not overwrite:
        raise UsageError(f"{dest} is not empty; give another folder, or --overwrite to replace an earlier export")
    for p in found:
        if _ours(dest, p):
            p.unlink()
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write to {dest}: {e.strerror or e}") from None


def _write_atomic(path: Path, write) -> None:
    """write(tmp), renamed over `path`: the temp name cannot be guessed (no link planted for it is
    written through) and the file gets the umask's mode, as a shard does (safetensors writes 0600)."""
    tmp = path.with_name(temp_name(path.name))
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _warnings(settings: dict) -> list[str]:
    """What the user should know before serving these tokens: pixels that are not vLLM's own."""
    resize = settings.get("resize")
    if resize in (None, "torchvision"):
        return []
    return [f"OUT was encoded with --resize {resize}: its pixels are not vLLM's own (vLLM resizes with "
            "torchvision), so an answer from these tokens may differ from vLLM's from the file; encode "
            "with --resize torchvision for tokens equal to vLLM's (docs/serving.md)"]


def export_vllm(out: str, dest, dtype: str = "float32", overwrite: bool = False) -> dict:
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)} (the engine's dtype)")
    try:
        cache = OutCache(str(out))
    except (FileNotFoundError, NotADirectoryError, ImportError, ValueError) as e:  # not an OUT, no protocol
        raise UsageError(str(e).splitlines()[0]) from None
    if "://" in str(dest):  # before Path(), which folds "s3://b" into "s3:/b"
        raise UsageError(f"{dest}: --to vllm writes a local folder (vLLM's ECExampleConnector reads one); "
                         "to serve an OUT in a store, use the connector (docs/serving.md)")
    dest = Path(dest)
    _clear(dest, overwrite)
    start = time.perf_counter()
    torch_dtype = getattr(torch, dtype)
    lines = []
    try:
        for path, entry in sorted(cache.by_path.items()):
            folder = dest / entry.key
            folder.mkdir(exist_ok=True)
            if folder.is_symlink():  # a handed-over DEST: never write through a link out of it
                raise UsageError(f"{folder} is a symbolic link: an export writes only its own folders")
            tokens = cache.tokens(entry.key).to(torch_dtype).contiguous()
            _write_atomic(folder / CACHE_FILE, lambda tmp, t=tokens: save_file({TENSOR: t}, str(tmp)))
            row = {"path": path, "key": entry.key}
            row.update({k: entry.row[k] for k in ROW_FIELDS if k in entry.row})
            lines.append(json.dumps(row))
        _write_atomic(dest / INDEX, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines)))
        report = {
            "producer": f"gemma4enc {__version__}",
            "source": str(out),
            "format": "vllm",
            "dtype": dtype,
            "key": "g4e- + sha256 of the content hash and the settings that shape a file's tokens (docs/serving.md)",
            "settings": cache.settings,
            "dir": str(dest),
            "rows": len(lines),
            "hashed": cache.hashed,
            "unkeyed": len(cache.unkeyed),
            "changed": len(cache.changed),  # of the unkeyed: changed or gone since their encode
            "warnings": _warnings(cache.settings),
        }
        _write_atomic(dest / INFO, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    except OSError as e:
        raise OutputError(f"cannot write the export in {dest}: {reason(e)}; run it again with --overwrite "
                          "once the folder takes writes") from None
    return report | {"seconds": round(time.perf_counter() - start, 3)}
