"""Decode + patchify in worker processes, each file under a timeout.

The tower's process only encodes; workers turn files into uint8 patches ahead of it. A file
whose decoder hangs past the timeout, or kills its worker, costs that file only: the worker is
replaced and the file gets a row saying why. Results come back in input order and at most
`ahead` files are in flight or waiting, so host memory stays flat however large the folder.

What a worker does to one file is prepare.py's (`prepare`, `Decoded`); this module holds only the
processes around it: their start, the order, the bound, the timeouts and the replacements.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from itertools import chain, islice
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator

from ..options import Options
from ..rows import Status
from . import video as decoding
from .kinds import Item
from .prepare import Decoded, prepare


def default_workers() -> int:
    """One core stays with the process that feeds the accelerator."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def _serve(conn, fn: Callable, options: Options) -> None:
    """A worker's loop: (seq, item) in, (seq, Decoded) out, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the parent's to handle;
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it kills its workers on the way out
    _die_with_parent()
    try:  # a decoder that eats all memory: let the kernel's OOM killer pick a worker, not the run
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        seq, item, decoding.THREADS = task
        try:
            result = fn(item, options)
        except Exception as e:  # noqa: BLE001
            result = Decoded(
                item, status=Status.DECODE_ERROR, error=f"{type(e).__name__}: {str(e)[:300]}"
            )
        try:
            conn.send((seq, result))
        except OSError:  # the run is gone (kill -9): nobody to tell, and no traceback to print
            return


def _die_with_parent() -> None:
    """Linux: a worker stuck in a decoder must not outlive a killed run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _context():
    # forkserver: workers fork from a clean process that never ran torch threads or our
    # manager thread, and have the decoders imported once; a replacement starts in milliseconds
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gemma4enc.media.workers"])
    return ctx


class _Worker:
    def __init__(self, ctx, fn: Callable, options: Options):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, fn, options), daemon=True, name="gemma4enc-decode"
        )
        self.proc.start()
        child.close()
        self.task: tuple[int, Item] | None = None
        self.deadline = float("inf")
        self.threads = 1  # decoder threads of the task in hand

    def give(self, seq: int, item: Item, timeout: float | None, threads: int = 1) -> None:
        self.task, self.threads = (seq, item), threads
        self.deadline = time.monotonic() + timeout if timeout else float("inf")
        self.conn.send((seq, item, threads))

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class DecodePool:
    """`pool.map(items)` yields one Decoded per item, in order; workers=0 decodes in-process."""

    def __init__(
        self,
        options: Options,
        workers: int | None = None,
        timeout: float | None = None,
        ahead: int | None = None,
        fn: Callable[[Item, Options], Decoded] = prepare,
    ):
        self.options, self.fn = options, fn
        self.workers = default_workers() if workers is None else workers
        self.timeout = timeout
        self.ahead = ahead or max(8 * self.workers, 64)
        self.replaced = 0  # workers killed for a timeout or found dead
        self._starter: threading.Thread | None = None
        self._started: list[_Worker] = []
        self._start_error: BaseException | None = None
        self._early: _Run | None = None  # decoding begun by start(head), for map() to go on with
        self._head: list[Item] = []

    def start(self, head: Iterable[Item] = ()) -> DecodePool:
        """Start the workers now, in the background (while torch imports and the model loads); map()
        takes them over. `head`: the files the run will most likely map() first: the workers begin
        on them at once, so the first batch is decoded by the time the tower can take it. map()
        goes on from there if its files begin with these (else what was decoded is dropped)."""
        if self.workers and self._starter is None:
            self._starter = threading.Thread(
                target=self._start_all, name="gemma4enc-decode-start", daemon=True
            )
            self._starter.start()
            self._head = list(islice(head, self.ahead))
            if self._head:
                self._early = _Run(self, _Plug(self._head))
        return self

    def _start_all(self) -> None:
        try:
            ctx = _context()
            for _ in range(self.workers):
                self._started.append(_Worker(ctx, self.fn, self.options))
        except BaseException as e:  # noqa: BLE001 - told by map(), in the caller's thread
            self._start_error = e

    def take_workers(self, ctx) -> list[_Worker]:
        """The workers start() began (waited for here, in a map()'s manager thread, not the caller's),
        topped up to `workers`; the pool keeps none of them after."""
        if self._starter is not None:
            self._starter.join()
            self._starter = None
            if self._start_error:
                raise self._start_error
        taken, self._started = self._started, []
        return taken + [_Worker(ctx, self.fn, self.options) for _ in range(self.workers - len(taken))]

    def close(self) -> None:
        """Stop workers that start() began and no map() took (the run ended before it decoded)."""
        if self._early is not None:
            self._early.stop()
            self._early = None
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        for w in self._started:
            w.kill()
        self._started = []

    def map(self, items: Iterable[Item]) -> Iterator[Decoded]:
        if self.workers == 0:
            yield from (self.fn(item, self.options) for item in items)
            return
        run, self._early = self._early, None
        items = iter(items)
        if run is not None:  # decoding began at start(head): go on if these files begin with those
            first = list(islice(items, len(self._head)))
            if first == self._head:
                run.items.plug(items)
            else:
                run.stop()  # its workers go with it; this map() starts its own
                run, items = None, chain(first, items)
        if run is None:
            run = _Run(self, items)
        try:
            yield from run.ordered()
        finally:
            run.stop()


PENDING = object()  # what a _Plug gives while its items are still to be plugged in


class _Plug:
    """The files of a map() begun before they were all known: the head at once, the rest once
    plug() hands them over (until then PENDING, so the workers wait instead of being told the end)."""

    def __init__(self, head: list[Item]):
        self.head, self.rest = deque(head), None

    def plug(self, rest: Iterator[Item]) -> None:
        self.rest = rest

    def __iter__(self) -> _Plug:
        return self

    def __next__(self):
        if self.head:
            return self.head.popleft()
        if self.rest is None:
            return PENDING
        return next(self.rest)


class _Run:
    """One map(): a manager thread feeds workers and collects results; the caller takes them in order."""

    def __init__(self, pool: DecodePool, items: Iterator[Item]):
        self.pool, self.items = pool, items
        self.ctx = _context()
        self.workers: list[_Worker] = []
        self.done: dict[int, Decoded] = {}
        self.cond = threading.Condition()
        self.submitted = self.taken = 0
        self.exhausted = self.stopping = False
        self.ahead_items: deque[Item] = deque()  # read ahead by a worker's count: see _next
        self.source_done = False
        self._refill()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._manage, name="gemma4enc-decode-manager", daemon=True)
        self.thread.start()

    def ordered(self) -> Iterator[Decoded]:
        while True:
            with self.cond:
                while (
                    self.taken not in self.done
                    and not self.failure
                    and not (self.exhausted and self.taken >= self.submitted)
                ):
                    self.cond.wait(1.0)
                if self.failure:
                    raise self.failure
                if self.taken not in self.done:
                    return  # every item has been yielded
                result = self.done.pop(self.taken)
                self.taken += 1
            yield result

    def stop(self) -> None:
        self.stopping = True
        self.thread.join()
        for w in self.workers:
            w.kill()

    def _manage(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            with self.cond:
                self.failure = e
                self.cond.notify_all()

    def _loop(self) -> None:
        pool = self.pool
        self.workers = pool.take_workers(self.ctx)
        while not self.stopping:
            self._feed()
            busy = [w for w in self.workers if w.task]
            if not busy:
                if self.exhausted:
                    return
                time.sleep(0.02)  # waiting for the caller to take results (the `ahead` bound)
                continue
            now = time.monotonic()
            wait_s = min(0.1, max(0.0, min(w.deadline for w in busy) - now))
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait_s)
            for w in busy:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._collect(w)
                elif time.monotonic() > w.deadline:
                    self._replace(
                        w,
                        Status.TIMEOUT,
                        f"decoding took longer than {pool.timeout:g} s "
                        "(--decode-timeout); its worker was stopped",
                    )

    def _feed(self) -> None:
        for w in self.workers:
            if self.exhausted or self.stopping:
                return
            if w.task is None and self.submitted - self.taken < self.pool.ahead:
                item = self._next()
                if item is PENDING:  # a head begun early: the rest is not known yet
                    return
                if item is None:
                    with self.cond:
                        self.exhausted = True
                        self.cond.notify_all()
                    return
                w.give(self.submitted, item, self.pool.timeout, self._threads())
                self.submitted += 1

    def _refill(self) -> None:
        while not self.source_done and len(self.ahead_items) < max(1, self.pool.workers):
            item = next(self.items, None)
            if item is PENDING:
                return
            if item is None:
                self.source_done = True
            else:
                self.ahead_items.append(item)

    def _next(self):
        """The next item, None at the end, or PENDING (a _Plug's rest not plugged in yet); as many
        as there are workers are read ahead, so that the last ones are known."""
        if not self.ahead_items:
            self._refill()
        if not self.ahead_items:
            return None if self.source_done else PENDING
        item = self.ahead_items.popleft()
        self._refill()
        return item

    def _threads(self) -> int:
        """Decoder threads for the file just taken: its share of the cores that would otherwise idle.

        While more files remain than idle workers could take, 1. In a run's tail the idle workers'
        cores (less those already lent) are shared among the files left, this one included, so a
        few long videos do not decode on one core each while the rest idle.
        """
        if not self.source_done:
            return 1
        idle = sum(1 for w in self.workers if w.task is None)  # the taker among them
        lent = sum(w.threads - 1 for w in self.workers if w.task is not None)
        return max(1, (idle - lent) // (len(self.ahead_items) + 1))

    def _collect(self, w: _Worker) -> None:
        try:
            if w.conn.poll():
                seq, result = w.conn.recv()
                w.task, w.deadline = None, float("inf")
                self._put(seq, result)
                return
        except (EOFError, OSError):
            pass
        w.proc.join(1)
        code = w.proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        self._replace(
            w, Status.DECODE_ERROR, f"the decoder crashed on this file ({how}); its worker was replaced"
        )

    def _replace(self, w: _Worker, status: str, message: str) -> None:
        seq, item = w.task
        w.kill()
        self.pool.replaced += 1
        self.workers[self.workers.index(w)] = _Worker(self.ctx, self.pool.fn, self.pool.options)
        self._put(seq, Decoded(item, status=status, error=message))

    def _put(self, seq: int, result: Decoded) -> None:
        with self.cond:
            self.done[seq] = result
            self.cond.notify_all()
