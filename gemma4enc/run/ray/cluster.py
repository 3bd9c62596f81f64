"""Connecting to Ray for --engine ray: a private loopback-only Ray, or a running cluster, with every
wait bounded.

Ray's own connect waits in its GCS client for as long as one waits when the address it is given
has nobody behind it: `--ray-address auto` on a machine where an earlier cluster died (its
address is still recorded in Ray's temp folder), or a HOST:PORT whose head is gone or frozen.
So before Ray is asked, the driver finds the address itself (RAY_ADDRESS, else the record `ray
start` leaves) and asks it, with a deadline, the first question of any gRPC server (HTTP/2's
preface, answered by a SETTINGS frame): a dead, frozen or foreign listener is told in one line
(exit 2) within PROBE_S, and Ray is not started.

What the cluster can hold is asked here too: the actor pool planned from its resources (one
actor per GPU, or per CPU share without GPUs), refused at once where Ray could never schedule it
(Ray would wait forever), and the first actor started and timed alone (START_S bounds it), so a
constructor that fails is told once, not restarted by a pool without end.

Ray is imported only in this package (run/ray/), only with --engine ray.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass

from ...errors import UsageError
from ...options import Options
from ...output.files import temp_folder

# Read by Ray at import: a private Ray binds to loopback only (its single-node mode) and sends no usage stats.
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # a worker process on a busy machine may take minutes to start; Ray's 60 s would kill it
    "RAY_worker_register_timeout_seconds": "600",
}
PROBE_S = "GEMMA4ENC_RAY_PROBE_S"  # seconds the cluster's head has to answer the driver's first question
PROBE_DEFAULT_S = 10.0
# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with its own SETTINGS
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4  # the frame type byte of the answer
ROOM_S = "GEMMA4ENC_RAY_ROOM_S"  # seconds to wait for a node an actor fits on, once none is left
START_S = "GEMMA4ENC_RAY_START_S"  # seconds the first actor may take to start (imports, tower load)
START_DEFAULT_S = 900.0  # generous: a loaded 2-core machine took minutes; a real failure is told at once


def _split(address: str, flag: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"{flag}: use auto or HOST:PORT, not {address!r}")
    return host.strip("[]"), int(port)


def probe(address: str, what: str, advice: str, flag: str = "--ray-address") -> None:
    """Ask HOST:PORT what a gRPC server must answer at once; raise UsageError saying what was
    found there (nothing, a frozen or dead process, something that is not Ray) within PROBE_S.
    `advice`: what to do where nothing listens or something else does."""
    seconds = float(os.environ.get(PROBE_S) or PROBE_DEFAULT_S)
    host, port = _split(address, flag)
    deadline = time.monotonic() + seconds
    try:
        with socket.create_connection((host, port), timeout=seconds) as s:
            s.sendall(_PREFACE)
            head = b""
            while len(head) < 9:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                got = s.recv(9 - len(head))
                if not got:
                    break
                head += got
    except TimeoutError:
        raise UsageError(
            f"{what} at {address} did not answer in {seconds:.0f} s (a frozen or overloaded head "
            f"node?); set {PROBE_S} to wait longer, or leave out --ray-address for a private Ray"
        ) from None
    except OSError as e:
        raise UsageError(f"{what} at {address} cannot be reached ({e.strerror or e}); {advice}") from None
    if len(head) < 9 or head[3] != _SETTINGS:
        raise UsageError(
            f"something listens at {address}, but it is not a Ray cluster's head (it did not answer "
            f"as Ray's GCS does); {advice}"
        )


def check_address(address: str) -> None:
    """Probe the cluster `address` names (auto: RAY_ADDRESS, else the one `ray start` recorded on
    this machine) before Ray is asked to join it. Ray Client addresses (ray://) are left to Ray."""
    if "://" in address:
        return
    if address != "auto":
        _split(address, "--ray-address")
        probe(address, "the Ray cluster", "check the address, or leave out --ray-address for a private Ray")
        return
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        if "://" not in env:
            probe(env, "the Ray cluster RAY_ADDRESS names", "check RAY_ADDRESS", flag="RAY_ADDRESS")
        return
    from ray._common.utils import get_ray_address_file  # Ray's own record: where `ray start` writes it

    record = get_ray_address_file(None)
    try:
        with open(record) as f:
            recorded = f.read().strip()
    except OSError:
        recorded = ""
    if not recorded:
        raise UsageError(
            f"--ray-address auto: no Ray cluster is recorded on this machine ({record} is absent) "
            "and RAY_ADDRESS is not set; start one with `ray start --head`, give HOST:PORT, or "
            "leave out --ray-address for a private Ray"
        )
    probe(
        recorded,
        f"--ray-address auto: the Ray cluster recorded in {record}",
        "the cluster has stopped and its record outlived it; start one with `ray start --head`, "
        "give HOST:PORT, or leave out --ray-address for a private Ray",
    )


@contextlib.contextmanager
def connect(address: str | None):
    """A private loopback-only Ray (address None), or the running cluster at `address`; shut down on exit.

    The environment it sets for Ray is put back on exit: a library user's process keeps its own."""
    saved = dict(os.environ)
    try:
        with _connected(address) as ray:
            yield ray
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _connected(address: str | None):
    if address is None:
        os.environ.update(LOCAL_ENV)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address != "auto":
            check_address(address)  # before Ray's import: a typo costs no second
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'gemma4enc[ray]'") from None
    import logging

    from ray._private import ray_constants

    if address == "auto":
        check_address(address)
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    if address is None:  # also when Ray was imported before the environment was set (a notebook, a test)
        ray_constants.ENABLE_RAY_CLUSTER = False
    logging.getLogger("ray").setLevel(logging.ERROR)
    # short: Ray's sockets live in it; named with this process's id so a sweep can tell a dead one's.
    # Ray makes its temp folder 0777 without the sticky bit: it gets one inside ours (0700), so no
    # other user of the machine can reach Ray's sockets, logs or session files
    temp = temp_folder("g4e-ray") if address is None else None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Ray prints worker deaths on stdout, which is --json's
            try:
                if address is None:  # "local" always starts a new Ray, never joins one found on the machine
                    ray.init(
                        address="local",
                        include_dashboard=False,
                        object_store_memory=256 << 20,
                        _temp_dir=os.path.join(str(temp), "ray"),  # set where address is None
                        log_to_driver=False,
                        logging_level=logging.ERROR,
                    )
                else:
                    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
                raise UsageError(
                    f"cannot start or join Ray ({address or 'local'}): {str(e).splitlines()[0]}"
                ) from None
            try:
                yield ray
            finally:
                ray.shutdown()
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


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


def first_actor_start(ray, pool: Pool, actor: type, *args) -> float:
    """Start one `actor(*args)` as the pool will (its resources, its constructor: imports and the
    tower) and time it: a constructor that fails is told once here, where a pool would restart it
    without end, and a machine too busy to start even one is told after START_S. Seconds it took."""
    limit = float(os.environ.get(START_S) or START_DEFAULT_S)
    actor_class = ray.remote(num_cpus=pool.cpus, num_gpus=pool.gpus or None, max_restarts=0)(actor)
    start = time.perf_counter()
    handle = actor_class.remote(*args)
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=limit)
    except ray.exceptions.GetTimeoutError:
        raise UsageError(
            f"a Ray actor did not start in {limit:.0f} s ({pool.cpus} CPU(s)"
            f"{' and a GPU' if pool.gpus else ''} each: the machine is too busy or the cluster "
            f"has no room); set {START_S} to wait longer"
        ) from None
    except ray.exceptions.RayError as e:
        raise UsageError(f"a Ray actor could not start: {first_line(e)}") from None
    finally:
        ray.kill(handle)
    return time.perf_counter() - start


def first_line(e: Exception) -> str:
    """The innermost reason of a Ray error (its text holds the actor's whole traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next(
        (line for line in reversed(lines) if "Error" in line.split(":")[0]), lines[-1] if lines else ""
    )
