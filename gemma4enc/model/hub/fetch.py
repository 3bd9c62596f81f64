"""A hub id → a local vision-only checkpoint folder: the config, the headers, then only the vision
tensors' bytes (ranges.py), into the cache (cache.py); offline, what the cache holds."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ...errors import UsageError
from ..layouts import INDEX, SINGLE, is_vision
from .cache import (
    FETCHED, atomic_write, cached, found_record, offline_folder, remember, repo_folder, snapshot
)
from .client import COMMIT, Hub, Log, host_resolves, hub_error, hub_host, offline, resolve, say
from .ranges import plan_ranges, pull_weights

SMALL = ("config.json", "preprocessor_config.json", "processor_config.json")  # copied whole when present


SMALL_LIMIT = 4 << 20  # bytes: a "small" config larger than this is skipped, not copied


def _weight_files(hub: Hub, names: set[str] | None) -> tuple[list[str], list[str], dict | None]:
    """→ (the weight files holding a vision tensor, those skipped, the index). `names` None: the
    file list is not known, so the index is asked for and its absence means one file."""
    if names is None or INDEX in names:
        raw = hub.optional(INDEX)
        if raw is not None:
            index = json.loads(raw)
            weight_map = index["weight_map"]
            shards = list(dict.fromkeys(sorted(weight_map.values())))
            files = [f for f in shards if any(is_vision(k) for k, v in weight_map.items() if v == f)]
            return files, [f for f in shards if f not in files], index
    if names is None or SINGLE in names:
        return [SINGLE], [], None
    raise UsageError(f"{hub.repo_id}: no {SINGLE} or {INDEX} at commit {hub.commit}")


def download(repo_id: str, commit: str, names: set[str] | None, log: Log) -> dict:
    """Fetch config + vision bytes at `commit` into the cache; → the record written to fetch.json."""
    from filelock import FileLock

    folder = repo_folder(repo_id) / commit
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / FETCHED).is_file():  # another process finished it while we waited
            return found_record(repo_id, folder, commit)
        hub = Hub(repo_id, commit, log)
        small = []
        for filename in SMALL:
            if names is None:  # not known: config.json must be there, the others may be
                data = hub.get(filename) if filename == "config.json" else hub.optional(filename)
            else:
                data = hub.get(filename) if filename in names else None
            if data is not None and len(data) <= SMALL_LIMIT:
                atomic_write(folder / filename, data)
                small.append(filename)
        files, skipped, _ = _weight_files(hub, names)
        the_plan = plan_ranges(hub, files, skipped, {"format": "pt", "repo": repo_id, "commit": commit})
        log(
            f"{repo_id}@{commit[:12]}: fetching {the_plan.tensors} vision tensors ({the_plan.vision_bytes:,} bytes "
            f"in {len(the_plan.requests)} ranges) of {len(files)} file(s), {the_plan.source_bytes:,} bytes in all"
        )
        pull_weights(hub, folder, the_plan)
        record = {
            "repo": repo_id,
            "commit": commit,
            "folder": str(folder),
            "files": small + [SINGLE],
            "tensors": the_plan.tensors,
            "vision_bytes": the_plan.vision_bytes,
            "bytes_fetched": hub.served,
            "source_files": files,
            "files_skipped": skipped,
            "source_bytes": the_plan.source_bytes,
            "ranges": len(the_plan.requests),
            "range_requests": not the_plan.unranged,
        }
        atomic_write(folder / FETCHED, json.dumps(record, indent=2).encode())
    return record


def config_file(repo_id: str, revision: str | None = None) -> Path:
    """A hub id's config.json alone: from our vision cache where it holds the revision, else as
    huggingface_hub downloads and caches it (its cache only, offline)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    found = cached(repo_id, revision)
    if found:
        return found[0] / "config.json"
    try:
        return Path(
            hf_hub_download(
                repo_id,
                "config.json",
                revision=revision,
                local_files_only=bool(_CACHE_ONLY) or offline() or not host_resolves(),
            )
        )
    except LocalEntryNotFoundError:
        why = _CACHE_ONLY[-1] if _CACHE_ONLY else f"the hub cannot be reached (HF_HUB_OFFLINE, or {hub_host()} does not resolve)"
        raise UsageError(f"{repo_id}: its config.json is not in the cache and {why}") from None
    except HfHubHTTPError as e:
        raise hub_error(repo_id, e) from None


# set while a model named by something the user did not choose is looked for (search FILE: the model
# a handed-over OUT's settings.json names): the cache only, never the hub; the text says why
_CACHE_ONLY: list[str] = []


@contextlib.contextmanager
def cache_only(why: str):
    """Within it, a hub id is found in the caches or refused in one line with `why`: never fetched.
    A module-level flag, not a context variable: the model may load in another thread."""
    _CACHE_ONLY.append(why)
    try:
        yield
    finally:
        _CACHE_ONLY.pop()


def fetch(repo_id: str, revision: str | None = None, log: Log = say, fetching: bool = False) -> dict:
    """A hub id → a local vision-only checkpoint folder; → what was done (folder, commit, bytes…).
    `fetching`: called by `gemma4enc fetch` (its offline error advises no fetch)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    pinned = repo_folder(repo_id) / revision if revision and COMMIT.fullmatch(revision) else None
    if pinned and (pinned / FETCHED).is_file():  # a commit never changes: no need to ask the hub
        return found_record(repo_id, pinned, revision)
    if _CACHE_ONLY:
        return found_record(repo_id, *offline_folder(repo_id, revision, _CACHE_ONLY[-1], fetching))
    if offline():
        why = "HF_HUB_OFFLINE is set"
        return found_record(repo_id, *offline_folder(repo_id, revision, why, fetching))
    if not host_resolves():  # the cache only, at once: not ~23 s of retries
        why = f"{hub_host()} cannot be resolved (offline? set HF_HUB_OFFLINE=1 to skip the hub)"
        return found_record(repo_id, *offline_folder(repo_id, revision, why, fetching))
    try:
        commit, names = resolve(repo_id, revision)
        folder = repo_folder(repo_id) / commit
        if (folder / FETCHED).is_file():
            record = found_record(repo_id, folder, commit)
        elif full := snapshot(repo_id, commit, local_only=True):  # a full one the user already has
            record = found_record(repo_id, full[0], commit)
        else:
            record = {**download(repo_id, commit, names, log), "cached": False}
        if (
            revision or "main"
        ) != commit:  # only now: offline, the name keeps pointing at a finished folder
            remember(repo_id, revision or "main", commit)
        return record
    except (httpx2.TransportError, OfflineModeIsEnabled):
        why = "the hub could not be reached"
        return found_record(repo_id, *offline_folder(repo_id, revision, why, fetching))
    except HfHubHTTPError as e:
        raise hub_error(repo_id, e) from None


def hub_files(repo_id: str, revision: str | None = None, log: Log = say) -> tuple[Path, str | None]:
    """What model.find_checkpoint needs: the folder and the commit it holds."""
    record = fetch(repo_id, revision, log)
    return Path(record["folder"]), record["commit"]
