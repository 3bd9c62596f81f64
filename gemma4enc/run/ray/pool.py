"""The driver's actor pool: Ray core actors that the driver starts, feeds one task at a time,
watches and kills itself, so that every wait of a round is one it can see, bound and report.

Why not Ray Data's actor pool (what this replaced): it restarted a dead actor in place
(`max_restarts=-1`) and counted the restart against the cluster's resources. An actor whose node
died while it started was restarted where no node had room for it, and Ray Data's scheduler then
waited for that restart, which could never succeed, with the live actor idle and nothing said: a
run that lost a node at the wrong moment never ended (issue 52). Here a dead actor is never
restarted (`max_restarts=0`): its task goes back to the queue (at most RETRIES times), a new actor
is asked for where the pool is short, and the round goes on with the actors that are up. Nothing
waits for an actor that is not up: a round ends when its tasks have come back or have been given
up, and the actors still starting are killed with it.

Every wait is bounded and said:
- no actor up and no live node with room for one, for ROOM_S: the run stops (exit 2);
- no actor up although there is room, for START_S: the run stops (exit 2);
- actors that die while they start, STARTS_IN_A_ROW times in a row: no more are asked for, and the
  run stops once none is left up (the reason is the last actor's own);
- a task out longer than TASK_S (a hung actor): its actor is killed and the task counts a death;
- while anything is waited for, a line every PROGRESS_S says which round, how many tasks are back,
  how many actors are up and starting, and what the pool waits for.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import UsageError
from .actor import items_of
from .cluster import ROOM_S, START_DEFAULT_S, START_S, Pool, first_line

RETRIES = 2  # deaths of a task's actor before the task is given up (the driver then splits it up)
ROOM_DEFAULT_S = 600.0  # long enough for an autoscaler to bring a replacement node
TASK_S = "GEMMA4ENC_RAY_TASK_S"  # seconds a task may be out on one actor before the actor is killed
TASK_FILE_S = 120.0  # per file of a task, when TASK_S is not set (plus TASK_BASE_S)
TASK_BASE_S = 600.0
PROGRESS_S = "GEMMA4ENC_RAY_PROGRESS_S"  # seconds between the lines said while the pool waits
PROGRESS_DEFAULT_S = 60.0
CHECK_S = 1.0  # the longest one wait for Ray lasts before the pool looks at its clocks again
STARTS_IN_A_ROW = 3  # actors dying while they start, in a row, before no more are asked for


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise UsageError(f"{name}={value!r}: must be a number of seconds") from None


@dataclass
class _Actor:
    handle: Any  # a Ray actor handle: its methods are called as handle.method.remote(...)
    name: str
    since: float  # when it was asked for, or when it took its task
    task: dict | None = None
    bound: float = 0.0  # seconds its task may be out (_task_bound), set when it takes one
    killed: bool = False  # by the pool, past TASK_S: its task's ref fails soon


@dataclass
class _Tally:
    """What one round has seen, for its progress lines and its stop messages."""

    tasks: int
    back: int = 0
    deaths: int = 0  # actors that died, working or starting
    starts_failed: int = 0  # in a row
    last_start_error: str = ""
    no_room_since: float | None = None
    none_up_since: float | None = None
    said: float = field(default_factory=time.monotonic)


class ActorPool:
    """`pool.actors` actors of `actor_class(*args)`, each with `pool.cpus` CPUs (and a GPU), for
    one run; `round(tasks, take)` runs a list of tasks through them."""

    def __init__(self, ray, pool: Pool, actor_class: type, args: tuple, log: Callable[[str], None]):
        self.ray, self.pool, self.args, self.log = ray, pool, args, log
        self.remote = ray.remote(num_cpus=pool.cpus, num_gpus=pool.gpus or None, max_restarts=0)(actor_class)
        self.prefix = f"gemma4enc-pool-{uuid.uuid4().hex[:8]}"  # names seen in `ray list actors`
        self.count = itertools.count()
        self.rounds = itertools.count(1)
        self.room_s = _seconds(ROOM_S, ROOM_DEFAULT_S)
        self.start_s = _seconds(START_S, START_DEFAULT_S)
        self.progress_s = _seconds(PROGRESS_S, PROGRESS_DEFAULT_S)
        self.task_s = _seconds(TASK_S, 0.0)  # 0: by the task's files

    def round(self, tasks: list[dict], take: Callable[[dict], None]) -> list[dict]:
        """Run `tasks` through the pool; `take(result)` for each one that comes back (it may raise,
        which ends the round). Returns the tasks given up, each with error_kind "died" and its error."""
        number = next(self.rounds)
        queue, tries = deque(tasks), dict.fromkeys((t["id"] for t in tasks), 0)
        lost: list[dict] = []
        starting: dict[object, _Actor] = {}  # ready ref -> an actor not yet up
        busy: dict[object, _Actor] = {}  # task ref -> the actor working on it
        idle: list[_Actor] = []
        tally = _Tally(len(tasks))
        try:
            while queue or busy:
                while idle and queue:
                    actor = idle.pop()
                    actor.task, actor.since = queue.popleft(), time.monotonic()
                    actor.bound = self._task_bound(actor.task)
                    busy[actor.handle.encode.remote(actor.task)] = actor
                self._fill(starting, len(busy) + len(idle), len(queue) + len(busy), tally)
                if not starting and not busy:
                    raise UsageError(
                        f"no Ray actor is left: {tally.starts_failed} died in a row while starting, the "
                        f"last with: {tally.last_start_error or 'no reason given'}"
                    )
                ready, _ = self.ray.wait([*starting, *busy], num_returns=1, timeout=CHECK_S)
                for ref in ready:
                    if ref in starting:
                        self._started(starting.pop(ref), ref, idle, tally)
                    else:
                        self._came(busy.pop(ref), ref, idle, queue, tries, lost, take, tally)
                self._watch(number, starting, busy, idle, tally)
        finally:
            for actor in [*starting.values(), *busy.values(), *idle]:
                self._kill(actor)
        return lost

    def _fill(self, starting: dict, up: int, wanted: int, tally: _Tally) -> None:
        """Ask for actors while the pool is short of its size and of the tasks left, unless actors
        keep dying while they start."""
        while (
            len(starting) + up < min(self.pool.actors, wanted) and tally.starts_failed < STARTS_IN_A_ROW
        ):
            name = f"{self.prefix}-{next(self.count)}"
            handle = self.remote.options(name=name).remote(*self.args)
            starting[handle.__ray_ready__.remote()] = _Actor(handle, name, time.monotonic())

    def _started(self, actor: _Actor, ref, idle: list, tally: _Tally) -> None:
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError as e:  # its node died, or its constructor raised
            tally.deaths += 1
            tally.starts_failed += 1
            tally.last_start_error = first_line(e)
            self._kill(actor)
            return
        tally.starts_failed = 0
        idle.append(actor)

    def _came(self, actor: _Actor, ref, idle, queue, tries, lost, take, tally: _Tally) -> None:
        task, actor.task = actor.task, None
        assert task is not None  # a busy actor holds its task
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:  # its actor (or its node) died: the task is retried
            tally.deaths += 1
            self._kill(actor)
            tries[task["id"]] += 1
            if tries[task["id"]] <= RETRIES:
                queue.appendleft(task)
            else:
                lost.append(task | {"error_kind": "died", "error": first_line(e)})
            return
        idle.append(actor)
        tally.back += 1
        take(result)

    def _watch(self, number: int, starting: dict, busy: dict, idle: list, tally: _Tally) -> None:
        """The round's clocks: stops where nothing can come up, kills a task's actor past TASK_S,
        and says what the pool waits for every PROGRESS_S."""
        now = time.monotonic()
        saying = now - tally.said >= self.progress_s
        # the cluster is asked only when it matters: no actor up, or a line to say
        room = self._room() if saying or not (busy or idle) else True
        tally.no_room_since = None if room else tally.no_room_since or now
        tally.none_up_since = None if (busy or idle) else tally.none_up_since or now
        if tally.none_up_since is not None and tally.no_room_since is not None:
            if now - max(tally.none_up_since, tally.no_room_since) >= self.room_s:
                raise UsageError(
                    f"no node left in the Ray cluster can hold an actor ({self.pool.cpus} CPU(s)"
                    f"{' and a GPU' if self.pool.gpus else ''}) for {self.room_s:.0f} s: a node was "
                    f"lost. The files done are saved; re-run once the cluster has room, or set {ROOM_S} "
                    "to wait longer"
                )
        elif tally.none_up_since is not None and now - tally.none_up_since >= self.start_s:
            raise UsageError(
                f"no Ray actor of this round came up in {self.start_s:.0f} s although the cluster has "
                f"room ({len(starting)} starting: the machine is too busy?); set {START_S} to wait longer"
            )
        for actor in busy.values():
            if not actor.killed and now - actor.since >= actor.bound:
                actor.killed = True
                self.log(f"a Ray actor held task {actor.task['id']} for {actor.bound:.0f} s; it is killed and the task retried")
                self._kill(actor)  # its ref now fails: the task counts a death and goes back
        if saying:
            tally.said = now
            oldest = max((now - a.since for a in busy.values()), default=0.0)
            waits = (
                f"{len(busy)} task(s) out, the oldest for {oldest:.0f} s"
                if busy
                else "an actor to come up" + ("" if room else " (no live node has room for one)")
            )
            self.log(
                f"ray: round {number}: {tally.back} of {tally.tasks} task(s) back, {len(busy) + len(idle)} "
                f"actor(s) up, {len(starting)} starting, {tally.deaths} died; waiting for {waits}"
            )

    def _room(self) -> bool:
        """Whether a live node of the cluster has the resources of one actor (an unanswered question
        counts as room: Ray's own errors will tell)."""
        try:
            nodes = self.ray.nodes()
        except Exception:  # noqa: BLE001
            return True
        return any(
            n.get("Alive")
            and n["Resources"].get("CPU", 0) >= self.pool.cpus
            and n["Resources"].get("GPU", 0) >= self.pool.gpus
            for n in nodes
        )

    def _task_bound(self, task: dict) -> float:
        """Seconds a task may be out: TASK_S, else TASK_BASE_S + TASK_FILE_S a file."""
        return self.task_s or TASK_BASE_S + TASK_FILE_S * len(items_of(task))

    def _kill(self, actor: _Actor) -> None:
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already, with its node
            pass
