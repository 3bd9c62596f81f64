"""--engine ray: the local pipeline (decode → tower → shard writer) in a Ray Data actor pool.

The driver (this process) keeps what makes a run safe to kill and repeat: OUT's lock, the list
of files still to do, and the manifest. It cuts that sorted list into tasks of --task-files
files, and Ray Data hands the tasks to a pool of actors, one per GPU (or per CPU share without
GPUs). Each actor loads the tower once and runs each task through the same `pipeline.run` as a
local run. It writes the task's shards under names made from the task's files
(shard-<hash>-000.safetensors), so a retried task overwrites its own shards and never leaves a
duplicate, and returns the task's rows; the driver appends them to the manifest as they come.
A kill leaves at most shards that no row names, which the next run removes (outdir.repair).

A file that cannot be decoded is a row, as locally. An actor that dies (the OOM killer, a
segfault) is restarted by Ray and its task retried RETRIES times; a task that still does not
come back is split into one task per file and tried once more, and a file that kills its actor
even alone is recorded as `worker_died`. Nothing is retried forever; no file goes missing.
A node that dies takes its actors along; Ray restarts them where they fit. When no live node
can hold one any more, the driver stops after ROOM_S rather than wait for Ray without end.
A round does not wait for its whole pool: it starts with the actors that are up and the others
join as they start, so a node lost while the pool starts shrinks the pool (its tasks go to the
live nodes' actors), and a slow start on a busy machine only delays it. The first actor alone is
started and timed first (START_S bounds it): a constructor that fails is told once, not retried.

Joining Ray, bounded and said in one line when it cannot be done, is raycluster.py's. Ray is
imported only there and here, only with --engine ray.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import OutputError, UsageError, output_error
from ..media.kinds import Item
from ..media.remote import is_url
from ..options import Options
from ..output.names import MANIFEST, task_shard_name
from ..rows import Row, Status
from .context import Run
from .pipeline import Progress, Summary, failed_row
from .raycluster import connect

RETRIES = 2  # Ray's retries of a task whose actor died, before the driver splits the task up
# files the driver holds as tasks at a time: a first run over millions of new files goes in rounds
# of this many as discovery finds them (run/stream.py); each round starts the actor pool anew
ROUND_FILES = 250_000
START_S = "GEMMA4ENC_RAY_START_S"  # seconds the first actor may take to start (imports, tower load)
ROOM_S = "GEMMA4ENC_RAY_ROOM_S"  # seconds to wait for a node an actor fits on, once none is left
ROOM_DEFAULT_S = 600.0  # long enough for an autoscaler to bring a replacement node
CHECK_S = 5.0  # how often the driver looks at the cluster during a round
START_DEFAULT_S = 900.0  # generous: a loaded 2-core machine took minutes; a real failure is told at once
DIED = f"its Ray worker died {RETRIES + 1} times in a row encoding it, alone too (out of memory or a crash; see Ray's logs)"


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


def _items(task: dict) -> list[Item]:
    return [Item(**d) for d in json.loads(str(task["items"]))]


class TaskEncoder:
    """One Ray actor: loads the tower once, then encodes one task per call with the local pipeline."""

    def __init__(self, options: Options, out: str):
        import ray

        from ..model.batching import budget_patches
        from ..model.load import open_tower
        from ..output.shards import shard_metadata
        from .tempsweep import sweep

        sweep()  # on this node: the task folders of actors killed mid-task
        device = (
            "cuda" if ray.get_gpu_ids() else "cpu"
        )  # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU
        self.options = replace(options, device=device, max_failures=None)  # the driver counts failures
        self.out = out
        self.tower, _, self.mode = open_tower(self.options)
        self.max_patches = budget_patches(self.tower, self.options, self.mode)
        self.metadata = shard_metadata(self.options, self.tower)
        self.store = None
        if is_url(out):  # OUT in a store: shards are written in a temp folder per task, then uploaded
            from ..output.store import Store

            self.store = Store(out)
            self.store.reached = True  # the driver reached it: a failure here is the store's, retried

    def __call__(self, batch: dict) -> dict:
        task = {"id": str(batch["id"][0]), "items": str(batch["items"][0])}
        if self.store is None:
            return self._encode(task, self.out)
        # the task's own folder, gone with it: an actor lives as long as Ray keeps it and is killed,
        # not closed, so a folder of the actor's would outlive every run; the pid in its name lets a
        # later run sweep the folder of an actor killed mid-task (tempsweep.py)
        local = tempfile.mkdtemp(prefix=f"gemma4enc-task-{os.getpid()}-")
        try:
            return self._encode(task, local)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _encode(self, task: dict, out: str) -> dict:
        from ..output.shards import ShardWriter
        from .pipeline import run

        sink = TaskSink(Path(out), task["id"], self.store)
        rows = sink.rows
        writer = ShardWriter(
            sink,
            self.options.out_dtype,
            self.metadata,
            self.options.shard_bytes,
            self.options.pooled,
            flush_seconds=float("inf"),
        )
        patches, error = 0, ""
        try:
            patches = run(
                _items(task), [self.tower], self.options, writer, self.mode, self.max_patches
            ).patches
            writer.close()
        except OutputError as e:
            error = f"output: {e}"  # OUT stopped taking writes: the whole run stops (exit 4)
        except Exception as e:  # noqa: BLE001 - the driver retries the files one by one and records the reason
            error = f"{type(e).__name__}: {e}"
        if error:
            try:
                writer.close(
                    discard=True
                )  # its thread must not outlive the task; the driver drops its shards
            except OutputError:
                pass
        return {
            "id": [task["id"]],
            "rows": [json.dumps([r.to_json() for r in rows] if not error else [], ensure_ascii=True)],
            "patches": [patches],
            "error": [error],
        }


class TaskSink:
    """Where a task's ShardWriter puts its shards and rows (output/shards.ShardSink): shards named
    by the task (shard-<task>-NNN), uploaded where OUT is a store, and the rows kept for the
    driver, which owns the manifest. The actor never takes OUT's lock nor reads its manifest."""

    records = False  # the rows are the driver's to record

    def __init__(self, folder: Path, task: str, store=None):
        self.folder, self.task, self.store = folder, task, store
        self.rows: list[Row] = []

    def next_shard(self) -> int:
        return 0

    def shard_name(self, k: int) -> str:
        return task_shard_name(self.task, k)

    def publish(self, path: Path) -> None:
        if self.store is None:
            return
        try:
            self.store.upload(path, path.name)
        finally:
            path.unlink(missing_ok=True)  # uploaded, or the task fails and is tried again whole

    def append(self, rows: list) -> None:
        self.rows.extend(rows)


@dataclass(frozen=True)
class Pool:
    actors: int
    gpus: int  # per actor: 1 or 0
    cpus: int  # per actor: 1 + its decode workers
    device: str  # what the actors run on: cuda or cpu


def plan_pool(resources: dict, options: Options) -> Pool:
    """Actors and their resources from the cluster's; refuses what cannot be scheduled (Ray would wait forever)."""
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if options.device not in ("auto", "cpu", "cuda"):
        raise UsageError(
            f"--engine ray gives each actor a GPU of its own or CPUs: use --device auto, cuda or cpu, "
            f"not {options.device}"
        )
    if options.device == "cuda" or (options.device == "auto" and gpus):
        actors = options.ray_actors or gpus
        if not gpus or actors > gpus:
            raise UsageError(
                f"{max(actors, 1)} GPU actor(s) need as many GPUs, and the Ray cluster has {gpus}; "
                "use --ray-actors, or --device cpu"
            )
        workers = options.workers if options.workers is not None else max(0, min(8, cpus // gpus - 1))
        pool = Pool(actors, 1, 1 + workers, "cuda")
    else:
        workers = options.workers or 0  # the actors themselves fill the cores
        pool = Pool(options.ray_actors or max(1, cpus // (1 + workers)), 0, 1 + workers, "cpu")
    if pool.actors * pool.cpus > cpus:
        raise UsageError(
            f"{pool.actors} actor(s) × {pool.cpus} CPUs (1 + --workers {pool.cpus - 1}) need "
            f"{pool.actors * pool.cpus} CPUs, and the Ray cluster has {cpus}"
        )
    return pool


def encode(todo: list[Item], run: Run) -> Summary:
    """Encode `todo` (a list, or discovery's stream) on Ray, in rounds of ROUND_FILES; rows land in
    OUT's manifest as tasks return. Call with OUT's lock held."""
    options = run.options
    if not todo:
        run.log(f"{run.done} files, all done already; Ray not started")
        return Summary(where={"ray_address": options.ray_address or "local"})
    from ..model.checkpoint import find_checkpoint

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
        took = _first_actor_start(ray, run, pool)
        run.log(f"a Ray actor started in {took:.1f} s")
        driver = _Driver(ray, run, pool, Summary(), run.bar(len(todo)))
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
        again = [it for t in lost for it in _items(t)]
        driver.run.log(
            f"{len(lost)} task(s) did not come back; trying their {len(again)} file(s) one by one"
        )
        lost = driver.round(make_tasks(again, 1))
    if lost:
        driver.record(
            [
                failed_row(
                    _items(t)[0], Status.WORKER_DIED if t["error"] == DIED else Status.ERROR, t["error"]
                )
                for t in lost
            ],
            0,
        )


def _actors_out(run: Run) -> str:
    """OUT as the actors reach it: its URL where it is in a store (the driver's copy is local)."""
    return run.out.for_actors()


def _first_actor_start(ray, run: Run, pool: Pool) -> float:
    """Start one actor as the pool will (its resources, its constructor: imports and the tower) and
    time it: a constructor that fails is told once here, where a pool would restart it without
    end, and a machine too busy to start even one is told after START_S. Seconds it took."""
    limit = float(os.environ.get(START_S) or START_DEFAULT_S)
    actor_class = ray.remote(num_cpus=pool.cpus, num_gpus=pool.gpus or None, max_restarts=0)(TaskEncoder)
    start = time.perf_counter()
    actor = actor_class.remote(run.options, _actors_out(run))
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=limit)
    except ray.exceptions.GetTimeoutError:
        raise UsageError(
            f"a Ray actor did not start in {limit:.0f} s ({pool.cpus} CPU(s)"
            f"{' and a GPU' if pool.gpus else ''} each: the machine is too busy or the cluster "
            f"has no room); set {START_S} to wait longer"
        ) from None
    except ray.exceptions.RayError as e:
        raise UsageError(f"a Ray actor could not start: {_first_line(e)}") from None
    finally:
        ray.kill(actor)
    return time.perf_counter() - start


def _first_line(e: Exception) -> str:
    """The innermost reason of a Ray error (its text holds the actor's whole traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next(
        (line for line in reversed(lines) if "Error" in line.split(":")[0]), lines[-1] if lines else ""
    )


class _NoRoom(Exception):
    """Raised in the driver's thread by its watchdog: no live node can hold an actor any more."""


@dataclass
class _Driver:
    """The driver's side of a run: hands tasks to the actor pool and lands their rows in the manifest."""

    ray: object
    run: Run
    pool: Pool
    summary: Summary
    progress: Progress

    def round(self, tasks: list[dict]) -> list[dict]:
        """Run tasks through the actor pool, recording each one's rows as it returns.

        Returns the tasks that did not come back, each with the reason; their shards are removed."""
        ray, pool = self.ray, self.pool
        ds = ray.data.from_items(tasks, override_num_blocks=len(tasks))
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # Ray 2.60 has no named parameter for max_restarts/max_task_retries yet
            ds = ds.map_batches(
                TaskEncoder,
                batch_size=1,
                fn_constructor_kwargs={"options": self.run.options, "out": _actors_out(self.run)},
                # one task in flight per actor: a death costs only its own task a retry
                compute=ray.data.ActorPoolStrategy(
                    size=min(pool.actors, len(tasks)), max_tasks_in_flight_per_actor=1
                ),
                num_cpus=pool.cpus,
                num_gpus=pool.gpus or None,
                max_restarts=-1,
                max_task_retries=RETRIES,
            )
        errors: dict[str, str] = {}
        try:
            with self._watch_room() as taking:
                for row in ds.iter_rows():
                    # a wait in Python, not in C: a _NoRoom already raised lands here, not in _take
                    while not taking.acquire(timeout=0.1):
                        pass
                    try:
                        self._take(row, errors)
                    finally:
                        taking.release()
        except _NoRoom:
            wait = float(os.environ.get(ROOM_S) or ROOM_DEFAULT_S)
            raise UsageError(
                f"no node left in the Ray cluster can hold an actor ({pool.cpus} CPU(s)"
                f"{' and a GPU' if pool.gpus else ''}) for {wait:.0f} s: a node was lost. The files "
                f"done are saved; re-run once the cluster has room, or set {ROOM_S} to wait longer"
            ) from None
        lost = [t | {"error": errors.get(t["id"]) or DIED} for t in tasks if errors.get(t["id"]) != ""]
        self._drop_shards_of(lost)
        return lost

    def _drop_shards_of(self, lost: list[dict]) -> None:
        """The shards of tasks that died after writing a shard, before their rows came back."""
        if not lost:
            return
        self.run.out.remove_shards(tuple(f"shard-{t['id']}-" for t in lost))

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

    def _take(self, row: dict, errors: dict[str, str]) -> None:
        """One task's result: its rows recorded, or its error kept for the retry."""
        error = str(row["error"])
        if error.startswith("output: "):
            raise OutputError(error.removeprefix("output: "))
        errors[str(row["id"])] = error
        if not error:
            rows = [Row.from_json(r) for r in json.loads(str(row["rows"]))]
            self.record(rows, int(row["patches"]), task=str(row["id"]))

    def record(self, rows: list[Row], patches: int, task: str = "") -> None:
        """Rows into the manifest (a store's: as one part per task, named after it)."""
        try:
            self.run.out.append(rows, tag=task)
        except OSError as e:
            raise output_error(MANIFEST, self.run.out.folder, e) from None
        self.summary.record(rows, patches)
        self.progress.advance(len(rows), patches)
        self.summary.check(self.run.options.max_failures)
