"""Where fetched vision folders live (`cache_root()/<org>--<name>/<commit>/`, finished once
`fetch.json` is written), the names a revision resolved to, and full snapshots already in the
Hugging Face cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...errors import UsageError
from ..layouts import INDEX, SINGLE, is_vision

FETCHED = "fetch.json"


def cache_root() -> Path:
    """$GEMMA4ENC_CACHE, else a folder beside huggingface_hub's cache (copying HF_HOME to an
    offline box carries it along)."""
    if os.environ.get("GEMMA4ENC_CACHE"):
        return Path(os.environ["GEMMA4ENC_CACHE"]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "gemma4enc" / "vision"


def repo_folder(repo_id: str) -> Path:
    return cache_root() / repo_id.replace("/", "--")


def atomic_write(path: Path, data: bytes) -> None:
    tmp = temp_beside(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remember(repo_id: str, revision: str, commit: str) -> None:
    refs = repo_folder(repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    atomic_write(refs / revision.replace("/", "--"), commit.encode())


def cached(repo_id: str, revision: str | None) -> tuple[Path, str] | None:
    """Our finished vision folder for this revision (a name we resolved before, or a commit), if any."""
    revision = revision or "main"
    ref = repo_folder(repo_id) / "refs" / revision.replace("/", "--")
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo_folder(repo_id) / commit
    return (folder, commit) if (folder / FETCHED).is_file() else None


def snapshot(repo_id: str, revision: str | None, local_only: bool) -> tuple[Path, str | None] | None:
    """A full snapshot the user already has in the HF cache: config, index and every vision shard."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path:
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=local_only))

    try:
        config = fetch("config.json")
        try:
            index = json.loads(fetch(INDEX).read_text())
            files = sorted({f for k, f in index["weight_map"].items() if is_vision(k)})
        except EntryNotFoundError:
            files = [SINGLE]
        for filename in files:
            fetch(filename)
    except (LocalEntryNotFoundError, EntryNotFoundError):
        return None
    return config.parent, config.parent.name if config.parent.parent.name == "snapshots" else None


def offline_folder(
    repo_id: str, revision: str | None, why: str, fetching: bool = False
) -> tuple[Path, str | None]:
    """Offline: our vision cache, else a full HF snapshot, else the one-line error (`fetching`:
    for `gemma4enc fetch` itself, which is not told to run itself)."""
    found = cached(repo_id, revision) or snapshot(repo_id, revision, local_only=True)
    if found:
        return found
    if fetching:
        raise UsageError(
            f"{repo_id}: not in the Hugging Face cache and {why}; run this fetch where the hub can be "
            f"reached (HF_HUB_OFFLINE unset), then copy its cache ({cache_root()}) here"
        )
    raise UsageError(
        f"{repo_id}: not in the Hugging Face cache and {why}; fetch it first where there is a network "
        f"(`gemma4enc fetch {repo_id}`, or `hf download {repo_id}`) or pass a local checkpoint folder"
    )


def found_record(repo_id: str, root: Path, commit: str | None) -> dict:
    """The record of a fetch that found everything here already."""
    record = (
        json.loads((root / FETCHED).read_text()) if (root / FETCHED).is_file() else {"repo": repo_id}
    )
    # the folder where it is now: a cache copied to another machine or path has moved
    return {**record, "commit": commit, "folder": str(root), "bytes_fetched": 0, "cached": True}


def temp_beside(path: Path) -> Path:
    """A new temp file in `path`'s folder (mkstemp: a random name, O_EXCL), so no link planted for a
    predictable name is written through."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)
