"""Before OUT is touched: the checkpoint is found, the devices exist, the settings are made exact.

A run that fails here leaves nothing behind, so the corrected command is not refused as "made
with other settings". What is recorded names the model one way however it was written (DIR/,
./DIR, a symlink, the absolute path) and the dtype the tower really runs in, not "auto".
A re-run may omit the flags: the ones not given are read back from OUT/settings.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..options import DEFAULT_FRAMES, Options
from ..output.settings import SETTINGS

# settings.json key → the encode parameter it stands for (sampling: frames, fps and max_frames, each on its own)
FLAGS = ("model", "revision", "dtype", "image_tokens", "video_tokens", "resize", "seek", "out_dtype", "pooled", "store")


def preflight(options: Options, light: bool = False) -> tuple[Options, dict]:
    """(options with the model path and dtype resolved, what else settings.json records).

    Raises UsageError for a model that is not there or a device this machine lacks. `light`
    (a re-run into a folder whose settings a loaded model wrote): a local model with a stated
    dtype is only resolved, without torch or transformers; the caller checks it fully once
    there is work."""
    local = Path(options.model).expanduser().is_dir()
    model = str(Path(options.model).expanduser().resolve()) if local else options.model
    if light and local and options.dtype != "auto":
        return replace(options, model=model), {"revision": None}
    from ..model.checkpoint import find_checkpoint
    from ..model.load import devices, dtype_name, parse_device

    ckpt = find_checkpoint(options.model, options.revision)
    dtype = options.dtype
    if options.engine == "local":  # a Ray actor's device is only known where it runs
        found = [parse_device(d) for d in devices(options)]
        dtype = dtype_name(options.dtype, found[0])
    # a hub id's towers (Ray actors too) open the commit resolved here, whatever its branch does next
    revision = None if local else ckpt.revision
    return replace(options, model=model, dtype=dtype, revision=revision), {"revision": revision}


def remembered(out: Path, given: Callable[[str], bool]) -> dict:
    """encode's parameters that were not given, as OUT/settings.json recorded them."""
    try:
        saved = json.loads((Path(out) / SETTINGS).read_text())
    except (OSError, ValueError):
        return {}
    kw = {key: saved[key] for key in FLAGS if key in saved and not given(key)}
    sampling = saved.get("sampling") or {}
    recorded = {"frames": sampling.get("frames") or DEFAULT_FRAMES, "fps": sampling.get("fps"),
                "max_frames": sampling.get("max_frames", DEFAULT_FRAMES)}
    return kw | {k: v for k, v in recorded.items() if sampling and not given(k)}


def no_effect(kw: dict, given: Callable[[str], bool]) -> list[str]:
    """Warnings for flags that were given but change nothing (they are neither refused nor recorded)."""
    notes = []
    if given("max_frames") and kw.get("fps") is None:
        notes.append("--max-frames has no effect without --fps (it caps --fps sampling); ignored")
    if given("frames") and kw.get("fps") is not None:
        notes.append("--frames has no effect with --fps (--max-frames caps the frames); ignored")
    return notes
