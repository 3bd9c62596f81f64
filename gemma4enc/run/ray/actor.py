"""What runs on the Ray actors: the tasks they are given and the actor that encodes them.

A task is a consecutive slice of the sorted list of files still to do, named by a hash of what it
holds, so the same files get the same id (and shard names) however often they are tried. Each
actor loads the tower once and runs each task through the same `pipeline.run` as a local run. It
writes the task's shards under names made from the task's id (shard-<id>-000.safetensors), so a
retried task overwrites its own shards and never leaves a duplicate, and returns the task's rows
for the driver to append to the manifest. The actor is told where shards go as a `ShardPlace`
(`Out.for_actors()`, picklable: a folder's, or a store's that uploads them); it never takes OUT's lock
nor reads its manifest, which are the driver's.

Its result says what went wrong as a field, `error_kind` (ErrorKind), beside the message:
"output" where OUT stopped taking writes (the driver stops the whole run, exit 4), "failed"
where the task raised (the driver tries its files one by one), "" where it went well.

This module runs in Ray's workers: it imports nothing of the driver's nor of the cluster's
(tests/test_layout.py holds it to that).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Literal

from ...errors import OutputError
from ...media.kinds import Item
from ...options import Options
from ...output.names import task_shard_name
from ...output.backend import ShardPlace
from ...rows import Row

# what a task's result says went wrong; "died" is the driver's, for a task that never came back
ErrorKind = Literal["", "output", "failed", "died"]


def make_tasks(items: list[Item], files: int) -> list[dict]:
    """Consecutive slices of the sorted list. A task's id hashes what it holds, so the same files
    get the same id (and shard names) however often they are tried."""
    tasks = []
    for i in range(0, len(items), files):
        text = json.dumps(
            [asdict(it) for it in items[i : i + files]], ensure_ascii=True
        )  # non-UTF-8 names as \udcXX
        tasks.append({"id": hashlib.sha1(text.encode()).hexdigest()[:16], "items": text})
    return tasks


def items_of(task: dict) -> list[Item]:
    """The files a task holds (make_tasks' `items`, read back)."""
    return [Item(**d) for d in json.loads(str(task["items"]))]


class TaskSink:
    """Where a task's ShardWriter puts its shards and rows (output/shards.ShardSink): shards named
    by the task (shard-<task>-NNN), each made OUT's by the place (uploaded where OUT is a store),
    and the rows kept for the driver, which alone appends to the manifest."""

    records = False  # the rows are the driver's to record

    def __init__(self, folder: Path, task: str, place: ShardPlace):
        self.folder, self.task, self.place = folder, task, place
        self.rows: list[Row] = []

    def first_shard(self) -> int:
        return 0  # a task's shards are named by the task: numbered from 0 in each

    def shard_name(self, k: int) -> str:
        return task_shard_name(self.task, k)

    def publish(self, path: Path) -> None:
        self.place.put(path)

    def append(self, rows: list) -> None:
        self.rows.extend(rows)


class TaskEncoder:
    """One Ray actor: loads the tower once, then encodes one task per call with the local pipeline."""

    def __init__(self, options: Options, place: ShardPlace):
        import ray

        from ...model.batching import budget_patches
        from ...model.load import open_tower
        from ...output.shards import shard_metadata
        from ..tempsweep import sweep

        sweep()  # on this node: the task folders of actors killed mid-task
        device = (
            "cuda" if ray.get_gpu_ids() else "cpu"
        )  # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU
        self.options = replace(options, device=device, max_failures=None)  # the driver counts failures
        self.place = place
        self.tower, _, self.mode = open_tower(self.options)
        self.max_patches = budget_patches(self.tower, self.options, self.mode)
        self.metadata = shard_metadata(self.options, self.tower)

    def encode(self, task: dict) -> dict:
        """One task ({"id", "items"}, from make_tasks): its shards written, its rows returned."""
        with self.place.staging() as folder:  # OUT itself, or a store's task folder
            return self._encode(task, folder)

    def _encode(self, task: dict, folder: Path) -> dict:
        from ...output.shards import ShardWriter
        from ..pipeline import run

        sink = TaskSink(folder, task["id"], self.place)
        rows = sink.rows
        writer = ShardWriter(
            sink,
            self.options.out_dtype,
            self.metadata,
            self.options.shard_bytes,
            self.options.pooled,
            flush_seconds=float("inf"),
        )
        patches, kind, error = 0, "", ""
        try:
            patches = run(
                items_of(task), [self.tower], self.options, writer, self.mode, self.max_patches
            ).patches
            writer.close()
        except OutputError as e:
            kind, error = "output", str(e)  # OUT stopped taking writes: the whole run stops (exit 4)
        except Exception as e:  # noqa: BLE001 - the driver retries the files one by one and records the reason
            kind, error = "failed", f"{type(e).__name__}: {e}"
        if kind:
            try:
                writer.close(
                    discard=True
                )  # its thread must not outlive the task; the driver drops its shards
            except OutputError:
                pass
        return {
            "id": task["id"],
            "rows": json.dumps([r.to_json() for r in rows] if not kind else [], ensure_ascii=True),
            "patches": patches,
            "error_kind": kind,
            "error": error,
        }
