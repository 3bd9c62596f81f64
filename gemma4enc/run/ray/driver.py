"""The Ray driver: this process's side of --engine ray, what makes a run safe to kill and repeat.

The driver keeps OUT's lock (taken by its caller), the list of files still to do, and the
manifest. It takes that sorted list in rounds of ROUND_FILES, cuts each round into tasks of
--task-files files (actor.make_tasks), and its own actor pool (pool.py) hands them to Ray actors,
one at a time each; the driver
appends each task's rows to the manifest as it comes back. A kill leaves at most shards that no
row names, which the next run removes (output/repair.py).

A file that cannot be decoded is a row, as locally. An actor that dies (the OOM killer, a
segfault, its node lost) is replaced and its task tried again, RETRIES times; a task that still
does not come back is split into one task per file and tried once more, and a file that kills
its actor even alone is recorded as `worker_died`. Nothing is retried forever; no file goes
missing. A round works with the actors that are up while the others start; every wait of the
pool is bounded and reported (pool.py).

OUT (`run.out`, output/out.py) is touched here three ways only: what the actors are told OUT is
(`for_actors`), the rows of a task into the manifest (`append`, a store's as one part per task),
and the shards of tasks that did not come back removed (`remove_shards`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from ...errors import OutputError, output_error
from ...media.kinds import Item
from ...output.names import MANIFEST
from ...rows import Row, Status
from ..context import Run
from ..pipeline import Progress, Summary, failed_row
from .actor import ErrorKind, TaskEncoder, items_of, make_tasks
from .cluster import connect, first_actor_start, plan_pool
from .pool import RETRIES, ActorPool

# files the driver holds as tasks at a time: a first run over millions of new files goes in rounds
# of this many as discovery finds them (run/stream.py); each round starts the actor pool anew
ROUND_FILES = 250_000
# the error of a task that never came back (error_kind "died"), even alone
DIED = f"its Ray worker died {RETRIES + 1} times in a row encoding it, alone too (out of memory or a crash; see Ray's logs)"


def encode(todo: list[Item], run: Run) -> Summary:
    """Encode `todo` (a list, or discovery's stream) on Ray, in rounds of ROUND_FILES; rows land in
    OUT's manifest as tasks return. Call with OUT's lock held."""
    options = run.options
    if not todo:
        run.log(f"{run.done} files, all done already; Ray not started")
        return Summary(where={"ray_address": options.ray_address or "local"})
    from ...model.checkpoint import find_checkpoint

    find_checkpoint(
        options.model, options.revision
    )  # a wrong --model is told here, not by every actor in turn
    run.ready()
    model = str(Path(options.model).resolve()) if Path(options.model).is_dir() else options.model
    options = replace(options, model=model)  # actors start elsewhere: no relative paths
    with connect(options.ray_address) as ray:
        pool = plan_pool(ray.cluster_resources(), options)
        run = replace(run, options=replace(options, workers=pool.cpus - 1))
        run.log(
            f"{run.done + len(todo)} files, {run.done} already done; Ray ({options.ray_address or 'local'}): "
            f"{pool.actors} actor(s) on {pool.device}, {pool.cpus} CPU(s) each, "
            f"tasks of {options.task_files} files"
        )
        args = (run.options, run.out.for_actors())
        took = first_actor_start(ray, pool, TaskEncoder, *args)
        driver = _Driver(run, ActorPool(ray, pool, TaskEncoder, args, run.log))
        run.log(f"a Ray actor started in {took:.1f} s")
        driver.progress = run.bar(len(todo))
        start = time.perf_counter()
        try:
            for files in _rounds(todo, max(ROUND_FILES, options.task_files)):
                _encode_round(driver, files, options.task_files)
        finally:
            driver.progress.close()
        summary = driver.summary
        summary.seconds = time.perf_counter() - start
    summary.where = {
        "device": pool.device,
        "ray_address": options.ray_address or "local",
        "ray_actors": pool.actors,
        "task_files": options.task_files,
    }
    return summary


def _rounds(todo, size: int):
    """`todo` (a list, or discovery's stream) in lists of `size` files, taken as they come."""
    files = []
    for item in todo:
        files.append(item)
        if len(files) == size:
            yield files
            files = []
    if files:
        yield files


def _encode_round(driver: _Driver, files: list[Item], task_files: int) -> None:
    """One round: its tasks through the pool; tasks that did not come back tried file by file; a
    file that still does not come back recorded as failed."""
    lost = driver.round(make_tasks(files, task_files))
    if lost:
        again = [it for t in lost for it in items_of(t)]
        driver.run.log(
            f"{len(lost)} task(s) did not come back; trying their {len(again)} file(s) one by one"
        )
        lost = driver.round(make_tasks(again, 1))
    if lost:
        driver.record(
            [
                failed_row(
                    items_of(t)[0],
                    Status.WORKER_DIED if t["error_kind"] == "died" else Status.ERROR,
                    DIED if t["error_kind"] == "died" else t["error"],
                )
                for t in lost
            ],
            0,
        )


@dataclass
class _Driver:
    """The driver's side of a run: hands tasks to the actor pool and lands their rows in the manifest."""

    run: Run
    pool: ActorPool
    summary: Summary = field(default_factory=Summary)
    progress: Progress | None = None  # the bar, set once the first actor has started

    def round(self, tasks: list[dict]) -> list[dict]:
        """Run tasks through the actor pool, recording each one's rows as it returns.

        Returns the tasks that did not come back, each with its `error_kind` and `error`; their
        shards are removed."""
        came: dict[str, dict] = {}  # task id -> its error_kind and error, for each task that came back
        died = {t["id"]: t for t in self.pool.round(tasks, lambda result: self._take(result, came))}
        lost = [t for t in (t | came.get(t["id"], died.get(t["id"], {})) for t in tasks) if t.get("error_kind")]
        if lost:  # tasks that died after writing a shard, before their rows came back
            self.run.out.remove_shards(tuple(f"shard-{t['id']}-" for t in lost))
        return lost

    def _take(self, row: dict, came: dict[str, dict]) -> None:
        """One task's result: its rows recorded, or its error kept for the retry."""
        kind = cast(ErrorKind, str(row["error_kind"]))
        if kind == "output":
            raise OutputError(str(row["error"]))
        came[str(row["id"])] = {"error_kind": kind, "error": str(row["error"])}
        if not kind:
            rows = [Row.from_json(r) for r in json.loads(str(row["rows"]))]
            self.record(rows, int(row["patches"]), task=str(row["id"]))

    def record(self, rows: list[Row], patches: int, task: str = "") -> None:
        """Rows into the manifest, then into the run's counts and bar."""
        try:
            self.run.out.append(rows, tag=task)
        except OSError as e:
            raise output_error(MANIFEST, self.run.out.url, e) from None
        self.summary.record(rows, patches)
        if self.progress is not None:  # set before the first round
            self.progress.advance(len(rows), patches)
        self.summary.check(self.run.options.max_failures)
