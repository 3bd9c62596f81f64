"""The Ray driver: this process's side of --engine ray, what makes a run safe to kill and repeat.

The driver keeps OUT's lock (taken by its caller), the list of files still to do, and the
manifest. It takes that sorted list in rounds of ROUND_FILES, cuts each round into tasks of
--task-files files (actor.make_tasks), and Ray Data hands the tasks to the actor pool; the driver
appends each task's rows to the manifest as it comes back. A kill leaves at most shards that no
row names, which the next run removes (output/repair.py).

A file that cannot be decoded is a row, as locally. An actor that dies (the OOM killer, a
segfault) is restarted by Ray and its task retried RETRIES times; a task that still does not
come back is split into one task per file and tried once more, and a file that kills its actor
even alone is recorded as `worker_died`. Nothing is retried forever; no file goes missing.
A node that dies takes its actors along; Ray restarts them where they fit. When no live node
can hold one any more, the driver stops after ROOM_S rather than wait for Ray without end.
A round does not wait for its whole pool: it starts with the actors that are up and the others
join as they start, so a node lost while the pool starts shrinks the pool (its tasks go to the
live nodes' actors), and a slow start on a busy machine only delays it.

OUT (`run.out`, output/out.py) is touched here three ways only: what the actors are told OUT is
(`for_actors`), the rows of a task into the manifest (`append`, a store's as one part per task),
and the shards of tasks that did not come back removed (`remove_shards`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...errors import OutputError, UsageError, output_error
from ...media.kinds import Item
from ...output.names import MANIFEST
from ...rows import Row, Status
from ..context import Run
from ..pipeline import Progress, Summary, failed_row
from .actor import ErrorKind, TaskEncoder, items_of, make_tasks
from .cluster import Pool, connect, first_actor_start, plan_pool

RETRIES = 2  # Ray's retries of a task whose actor died, before the driver splits the task up
# files the driver holds as tasks at a time: a first run over millions of new files goes in rounds
# of this many as discovery finds them (run/stream.py); each round starts the actor pool anew
ROUND_FILES = 250_000
ROOM_S = "GEMMA4ENC_RAY_ROOM_S"  # seconds to wait for a node an actor fits on, once none is left
ROOM_DEFAULT_S = 600.0  # long enough for an autoscaler to bring a replacement node
CHECK_S = 5.0  # how often the driver looks at the cluster during a round
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
        driver = _Driver(ray, run, pool)
        took = first_actor_start(ray, pool, TaskEncoder, run.options, run.out.for_actors())
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
                    t["error"],
                )
                for t in lost
            ],
            0,
        )


class _NoRoom(Exception):
    """Raised in the driver's thread by its watchdog: no live node can hold an actor any more."""


@dataclass
class _Driver:
    """The driver's side of a run: hands tasks to the actor pool and lands their rows in the manifest."""

    ray: object
    run: Run
    pool: Pool
    summary: Summary = field(default_factory=Summary)
    progress: Progress | None = None  # the bar, set once the first actor has started

    def round(self, tasks: list[dict]) -> list[dict]:
        """Run tasks through the actor pool, recording each one's rows as it returns.

        Returns the tasks that did not come back, each with its `error_kind` and `error`; their
        shards are removed."""
        ray, pool = self.ray, self.pool
        ds = ray.data.from_items(tasks, override_num_blocks=len(tasks))
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # Ray 2.60 has no named parameter for max_restarts/max_task_retries yet
            ds = ds.map_batches(
                TaskEncoder,
                batch_size=1,
                fn_constructor_kwargs={"options": self.run.options, "out": self.run.out.for_actors()},
                # one task in flight per actor: a death costs only its own task a retry
                compute=ray.data.ActorPoolStrategy(
                    size=min(pool.actors, len(tasks)), max_tasks_in_flight_per_actor=1
                ),
                num_cpus=pool.cpus,
                num_gpus=pool.gpus or None,
                max_restarts=-1,
                max_task_retries=RETRIES,
            )
        came: dict[str, dict] = {}  # task id -> its error_kind and error, for each task that came back
        try:
            with self._watch_room() as taking:
                for row in ds.iter_rows():
                    # a wait in Python, not in C: a _NoRoom already raised lands here, not in _take
                    while not taking.acquire(timeout=0.1):
                        pass
                    try:
                        self._take(row, came)
                    finally:
                        taking.release()
        except _NoRoom:
            wait = float(os.environ.get(ROOM_S) or ROOM_DEFAULT_S)
            raise UsageError(
                f"no node left in the Ray cluster can hold an actor ({pool.cpus} CPU(s)"
                f"{' and a GPU' if pool.gpus else ''}) for {wait:.0f} s: a node was lost. The files "
                f"done are saved; re-run once the cluster has room, or set {ROOM_S} to wait longer"
            ) from None
        died = {"error_kind": "died", "error": DIED}
        lost = [t for t in (t | came.get(t["id"], died) for t in tasks) if t["error_kind"]]
        if lost:  # tasks that died after writing a shard, before their rows came back
            self.run.out.remove_shards(tuple(f"shard-{t['id']}-" for t in lost))
        return lost

    @contextlib.contextmanager
    def _watch_room(self):
        """A thread that looks at the cluster every CHECK_S while a round runs. Ray restarts an actor
        whose node died wherever it fits, and waits for room without end, and so does Ray Data: once
        no live node can hold an actor for ROOM_S, the watchdog raises _NoRoom in the driver's thread,
        in Ray Data's polling loop (as Ctrl-C would), so the run stops and says why.

        Yields the lock the driver holds while it records a task: the watchdog fires only with it
        taken, and keeps it, so _NoRoom never lands halfway through writing a task's rows."""
        taking, stop, target = threading.Lock(), threading.Event(), threading.get_ident()
        wait = float(os.environ.get(ROOM_S) or ROOM_DEFAULT_S)

        def watch():
            since = None  # when the cluster was first seen without room for an actor
            while not stop.wait(CHECK_S):
                since = None if self._room() else since or time.monotonic()
                late = since is not None and time.monotonic() - since >= wait
                if late and taking.acquire(blocking=False):
                    # not _thread.interrupt_main: it does nothing where SIGINT is ignored (a job
                    # started with & from a script), which is where a hang hurts most
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(target), ctypes.py_object(_NoRoom)
                    )
                    return

        watchdog = threading.Thread(target=watch, name="g4e-ray-room", daemon=True)
        watchdog.start()
        try:
            yield taking
        finally:
            stop.set()
            watchdog.join()

    def _room(self) -> bool:
        """Whether a live node of the cluster has the resources of one actor."""
        pool = self.pool
        try:
            nodes = self.ray.nodes()
        except Exception:  # noqa: BLE001 - the cluster does not answer: Ray's own errors will tell
            return True
        return any(
            n.get("Alive")
            and n["Resources"].get("CPU", 0) >= pool.cpus
            and n["Resources"].get("GPU", 0) >= pool.gpus
            for n in nodes
        )

    def _take(self, row: dict, came: dict[str, dict]) -> None:
        """One task's result: its rows recorded, or its error kept for the retry."""
        kind: ErrorKind = str(row["error_kind"])
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
            raise output_error(MANIFEST, self.run.out.folder, e) from None
        self.summary.record(rows, patches)
        self.progress.advance(len(rows), patches)
        self.summary.check(self.run.options.max_failures)
