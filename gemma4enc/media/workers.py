"""Decode + patchify in worker processes, each file under a timeout.

The tower's process only encodes; workers turn files into uint8 patches ahead of it. A file
whose decoder hangs past the timeout, or kills its worker, costs that file only: the worker is
replaced and the file gets a row saying why. Results come back in input order and at most
`ahead` files are in flight or waiting, so host memory stays flat however large the folder.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain, islice
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator

from ..options import Options
from ..rows import Status
from . import video as decoding
from . import webdataset
from .decode import DecodeError, decode, prefit
from .kinds import Item
from .patches import DIVIDE, MULTIPLY, Patches, patchify


@dataclass
class Decoded:
    """One file made ready for the tower, or the reason it cannot be (status + error)."""

    item: Item
    patches: list[Patches] = field(default_factory=list)  # one per image / sampled frame
    width: int = 0  # decoded size, after orientation
    height: int = 0
    video: dict = field(default_factory=dict)  # frame_indices, timestamps and stream facts
    sha256: str | None = None
    status: str = Status.OK
    error: str | None = None
    sidecar: dict | None = None  # a tar member's: its sample's .json / .txt (webdataset.sidecars)


REREADS = 2  # --hash: times a local file rewritten while it was read is read again


def prepare(item: Item, options: Options, rereads: int = REREADS) -> Decoded:
    """Decode + patchify one file; every failure is caught and kept with the file.

    With --hash the file is hashed, then decoded: two reads. A local file rewritten between them
    (its ctime moves, whatever its size and mtime say) would pair a hash with other bytes' tokens,
    so it is read again, up to `rereads` times, then given up as unreadable."""
    if item.error:  # discovery could not even look at it, and said why
        return Decoded(item, status=item.status or Status.UNREADABLE, error=item.error)
    if item.kind == "unknown":
        return Decoded(item, status=Status.UNSUPPORTED, error="not an image or video format we know")
    if item.size == 0:
        return Decoded(item, status=Status.EMPTY, error="the file is empty (0 bytes)")
    elsewhere = item.path[:1] != "/" or item.root is not None and item.root.endswith(".tar")
    source = item.path
    try:
        if elsewhere:  # a URL or a tar's member: the decoders read a file object
            source = webdataset.open_source(item.path, item.root, item.rel)
        before = _stamp(item.path) if options.hash and not elsewhere else None
        digest = sha256(item.path, item.root, item.rel) if options.hash else None
        budget = options.image_tokens if item.kind == "image" else options.video_tokens
        shrink = prefit if item.kind == "video" and options.resize == "fast" else lambda image, _: image
        # --resize torchvision: torch's resize, and the image processor's own rescale for images
        resize = "torchvision" if options.resize == "torchvision" else "pil"
        unit = MULTIPLY if resize == "torchvision" and item.kind == "image" else DIVIDE
        frames = decode(
            source,
            item.kind,
            options.sampling,
            options.video_backend,
            options.max_image_pixels,
            transform=lambda image: patchify(shrink(image, budget), budget, resize, unit),
            fit=budget if options.resize == "fast" else None,
            seek=options.seek,
        )
        video = {}
        if item.kind == "video":
            video = {
                "frame_indices": frames.indices,
                "timestamps": frames.timestamps,
                **{
                    k: frames.info[k]
                    for k in ("fps", "duration", "total_frames", "backend")
                    if k in frames.info
                },
            }
            if frames.info.get("truncated"):  # a cut file: sampled from the frames it has
                video["truncated"] = True
            if frames.info.get("missing"):  # asked for, not decodable: the row says which
                video["missing_frames"] = frames.info["missing"]
            if frames.info.get("frames_asked", 0) > len(frames.indices):  # --seek folded some together
                video["frames_asked"] = frames.info["frames_asked"]
        if before is not None and _stamp(item.path) != before:  # rewritten while it was read
            if rereads > 0:
                return prepare(item, options, rereads - 1)
            return Decoded(
                item,
                status=Status.UNREADABLE,
                error="the file kept changing while it was read (its hash and its tokens would differ)",
            )
        sidecar = None
        if elsewhere and webdataset.member_of(item.path, item.root, item.rel):
            sidecar = webdataset.sidecars(item.root, item.rel) or None
        return Decoded(
            item,
            frames.images,
            int(frames.info["width"]),
            int(frames.info["height"]),
            video,
            digest,
            sidecar=sidecar,
        )
    except DecodeError as e:
        if not elsewhere and not os.path.exists(
            item.path
        ):  # decoders word a vanished file as a corrupt one
            return Decoded(
                item, status=Status.NOT_FOUND, error="the file vanished before it was decoded"
            )
        return Decoded(item, status=e.status, error=str(e))
    except FileNotFoundError:
        return Decoded(item, status=Status.NOT_FOUND, error="the file vanished before it was decoded")
    except PermissionError as e:
        return Decoded(item, status=Status.UNREADABLE, error=f"cannot read: {e.strerror or e}")
    except MemoryError:
        return Decoded(item, status=Status.TOO_LARGE, error="decoding it ran out of host memory")
    except Exception as e:  # noqa: BLE001 - a decoder's surprise must cost one file, not the run
        return Decoded(item, status=Status.DECODE_ERROR, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        if source is not item.path:
            source.close()


def _stamp(path: str) -> tuple[int, int, int, int]:
    """What any write to a local file moves: ctime cannot be set back as mtime can (os.utime)."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256(path: str, root: str | None = None, rel: str | None = None) -> str:
    source = webdataset.open_source(path, root, rel)
    with source if source is not path else open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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

    def _take_workers(self, ctx) -> list[_Worker]:
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
        self.workers = pool._take_workers(self.ctx)
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
