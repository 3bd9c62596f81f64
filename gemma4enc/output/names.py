"""OUT's names and patterns, in one place: what gemma4enc writes in an output folder (or under a
store's prefix), and so what it may clean up there and nothing else.

  settings.json                      the settings that shape the output, recorded once
  manifest.jsonl                     one row per input file, appended; the latest row of a path wins
  manifest.parts/NNNNNNNNNNNN-RUN.jsonl   a store's rows written since its base (storebackend.py)
  shard-NNNNNN.safetensors           a local run's shards; shard-<task>-NNN from a Ray task
  gemma4enc.lock                     while a run holds OUT
  search-index.*                     search's cache (vecstore.py)
  .gemma4enc-<name>.<pid>-<16 hex>.tmp   a write in flight (gone once it is renamed into place)
"""

from __future__ import annotations

import os
import re
import secrets

MANIFEST = "manifest.jsonl"
SETTINGS = "settings.json"  # OUT's record of the settings that shape the output
LOCK = "gemma4enc.lock"
SEARCH_INDEX = (  # search's cache (output/vecstore.py)
    "search-index.json", "search-index.vectors", "search-index.rows.npy", "search-index.paths",
    "search-index.faiss", "search-index.lock",
)
PARTS = "manifest.parts"  # a store's manifest parts (storebackend.py)
COMPACTED = "~compacted.jsonl"
PART_RE = re.compile(r"^manifest\.parts/(\d{12})[-~][^/]*\.jsonl$")

# shard-000012 from a local run; shard-<16 hex of the task's files>-000 from a Ray task
SHARD_RE = re.compile(r"^shard-(\d{6}|[0-9a-f]{16}-\d{3})\.safetensors$")
LOCAL_NAME = "shard-{:06d}.safetensors"  # a local run's k-th shard

# our temp files, and only ours (a user's .draft.tmp in OUT is never touched):
# .gemma4enc-<name>.<pid>-<16 hex>.tmp, and the names earlier versions used (.gemma4enc-<name>.<pid>.tmp,
# .<our file>.<pid>.tmp, .write-test-<pid>.tmp)
TEMP_RE = re.compile(
    r"^\.gemma4enc-.+\.\d+(-[0-9a-f]{16})?\.tmp$|^\.(shard-[0-9a-f-]+\.safetensors|manifest\.jsonl|settings\.json)"
    r"\.\d+\.tmp$|^\.write-test-\d+\.tmp$"
)


LINE_MAX = 16 << 20  # a manifest line longer than this is no row gemma4enc wrote: never held or parsed


def manifest_chain(parts: list[str]) -> tuple[list[str], bool]:
    """A store's manifest is its base then its parts (names as PART_RE's, in name order), from the
    last `~compacted` part on where there is one: that part holds the whole manifest while a
    compaction replaces the base (docs/remote.md). (the parts to read, whether the base is read)."""
    resets = [i for i, n in enumerate(parts) if n.endswith(COMPACTED)]
    return (parts[resets[-1]:], False) if resets else (list(parts), True)


def unnamed_shards(names, named: set[str]) -> list[str]:
    """OUT's shards among `names` that no latest row names (`named`: Ledger.shards()): dead, an
    interrupted run's or those only superseded rows name. The one rule repair, compaction and a
    store's compaction delete by."""
    return sorted(n for n in names if SHARD_RE.match(n) and n not in named)


def temp_name(name: str) -> str:
    """A temp name nobody can guess (64 random bits): a link planted in OUT for the next pids' temp
    files (a handed-over OUT) is never written through."""
    return f".gemma4enc-{name}.{os.getpid()}-{secrets.token_hex(8)}.tmp"


def task_shard_name(task: str, k: int) -> str:
    """The k-th shard of a Ray task: named by the task's files, so a retried task overwrites its own."""
    return f"shard-{task}-{k:03d}.safetensors"


def not_an_output(out) -> str:
    """What every command says of a folder without a manifest."""
    return f"{out}: no {MANIFEST}; is this a gemma4enc output folder?"
