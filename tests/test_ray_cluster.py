"""--engine ray on a Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster): a node
that dies mid-run takes its actor and the task it holds with it.

With room left on the other node, a run from an s3:// folder and tar to an s3:// OUT (a loopback
S3, no folder shared by the nodes' actors) must still end with every file once, the local
engine's tokens bit for bit, a clean verify, and nothing left to redo. With no node left that can hold an
actor, Ray would wait without end: the run must stop and say so, and resume once a node is added.

The doomed node's actor is made to hang on its first task (a sitecustomize hook, loaded only by the
Ray workers that node starts), so the node is removed exactly while a task is in flight on it,
however fast or slow the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import torch

import gemma4enc

from .corpus import good_media
from .helpers import (
    BASE, RUN, by_name, encode, encode_argv, loopback_s3, photo, ray_worker_hook, shard_tokens, verify
)

pytest.importorskip("ray.cluster_utils")
# every test here ends, or the run does; slow (a Ray cluster each): `make test-all` and CI run them
pytestmark = [pytest.mark.usefixtures("bounded"), pytest.mark.slow]

START_S = 300  # an actor on a loaded 2-core machine may take a minute or more to start
HANG_ENV = "G4E_TEST_HANG"

# Set only in the doomed node's raylet environment, so only its workers see it: their first call to
# the pipeline's _encode writes the task's files to a mark (the test's event) and then never returns.
HANG = ray_worker_hook(HANG_ENV, """
    import threading
    names = " ".join(os.path.basename(d.item.path) for d in window)
    mark = os.path.join(os.environ["G4E_TEST_HANG"], str(os.getpid()))
    with open(mark + ".tmp", "w") as f:
        f.write(names)
    os.replace(mark + ".tmp", mark)  # the test never reads half a mark
    threading.Event().wait()  # until the node, and this process with it, is killed
""")

# The same node's actors hang instead while they start: in the constructor of a pool actor (named
# gemma4enc-pool-…; the driver's own first actor, which it times, starts as usual), after a mark.
HANG_AT_START = ray_worker_hook(HANG_ENV, """
    import threading, ray
    if (ray.get_runtime_context().get_actor_name() or "").startswith("gemma4enc-pool-"):
        mark = os.path.join(os.environ["G4E_TEST_HANG"], str(os.getpid()))
        open(mark + ".tmp", "w").close()
        os.replace(mark + ".tmp", mark)
        threading.Event().wait()  # until the node, and this process with it, is killed
    init(self, *args, **kwargs)
""", module="gemma4enc.run.ray.actor", name="TaskEncoder.__init__", first="self", own="init")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Ten files: five tasks of two, more than the two actors hold at once."""
    root = good_media(tmp_path_factory.mktemp("cluster") / "media")
    for i in range(4):
        photo(260 + 10 * i, 300, seed=20 + i).save(root / f"extra{i}.jpg", quality=92)
    return root


@pytest.fixture(scope="module")
def local(media, ckpt, tmp_path_factory):
    """The local engine's tokens: what Ray must reproduce, bit for bit."""
    out = tmp_path_factory.mktemp("local") / "out"
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    return shard_tokens(out)[1]


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """make(doomed_cpus, hang) → (cluster, the node to kill, the folder its hanging actor marks): a
    head of 1 CPU and a worker node whose Ray workers run `hang`; shut down after the test."""
    from ray.cluster_utils import Cluster

    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir(), marks.mkdir()
    # the nodes' processes, and so their workers, inherit this process's environment: the hook, and
    # this checkout's package rather than whichever one is installed
    here = Path(gemma4enc.__file__).parents[1]
    paths = [str(hook), str(here), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # the nodes' sessions and the address record Cluster writes go in a folder of the test's own,
    # removed after it: not /tmp/ray, where they would outlive the test and point others' `auto`
    # at a dead cluster (short: Ray's sockets live in it)
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="g4e-c-")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    made = []

    def make(doomed_cpus: int, hang: str = HANG):
        (hook / "sitecustomize.py").write_text(hang)
        c = Cluster(initialize_head=True, head_node_args={**node(1), "include_dashboard": False})
        made.append(c)
        return c, c.add_node(**node(doomed_cpus), env_vars={HANG_ENV: str(marks)}), marks

    try:
        yield make
    finally:
        for c in made:
            c.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def node(cpus: int) -> dict:
    return {"num_cpus": cpus, "object_store_memory": 80 << 20}


def said(err: Path) -> str:
    """What the driver said: its stderr, and its --log-file (driver.log beside it: the progress lines
    a quiet run writes only there)."""
    log = err.with_name("driver.log")
    return err.read_text() + (f"\n--- driver.log:\n{log.read_text()}" if log.exists() else "")


def wait_for_mark(marks: Path, proc: subprocess.Popen, err: Path, seconds: float) -> str:
    """The files of the task hanging on the doomed node, once it holds one."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [p for p in marks.iterdir() if not p.name.endswith(".tmp")]
        if found:
            return found[0].read_text()
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended ({proc.returncode}) before a task reached the doomed node:\n{said(err)}"
            )
        time.sleep(0.1)
    pytest.fail(f"no task reached the doomed node in {seconds} s:\n{said(err)}")


def run_losing_a_node(c, doomed, marks, args, err: Path, env: dict) -> tuple[int, str, list[str]]:
    """(exit code, stdout, the files in flight on the node): `gemma4enc encode ARGS`, whose node
    `doomed` is removed while its actor holds a task."""
    with err.open("w") as stderr:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            in_flight = wait_for_mark(marks, proc, err, 2 * START_S)
            c.remove_node(doomed)  # kills its raylet and its workers: the hanging actor and its task
            try:
                # the survivor alone does the rest: on a loaded 2-core machine (load 30) minutes
                stdout, _ = proc.communicate(timeout=2 * START_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the run did not end in {2 * START_S} s after its node died:\n{said(err)}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, stdout, in_flight.split()


def all_once_as_local(out: Path, media: Path, local: dict) -> None:
    """Every file one ok row, the local engine's tokens bit for bit, and verify clean."""
    rows = by_name(out)  # one row per file: the lost task's files were neither dropped nor doubled
    assert set(rows) == {p.name for p in media.iterdir()}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    got = shard_tokens(out)[1]
    assert set(got) == set(local)
    for path, tokens in got.items():
        assert torch.equal(tokens, local[path]), path
    report = verify(out)
    assert report["ok"] and not report["warnings"], report


@pytest.fixture(scope="module")
def s3():
    """A loopback S3 (moto), in this process's environment and so in the nodes' and their workers'
    too (the nodes are started after it)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with loopback_s3("cluster") as (fs, _):
        yield fs


@pytest.fixture
def busy_cores():
    """Every core of the machine kept busy by a spinning process while the test runs: a slow start
    is a reason to wait, never to stop."""
    import sys

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


@pytest.mark.parametrize("lost", ["mid_task", "while_starting"])
def test_a_node_lost_mid_run_loses_no_file_and_changes_no_token(
    s3, media, ckpt, local, two_nodes, tmp_path, lost, request
):
    """Two actors of 1 CPU, one per node, inputs and OUT in S3: the survivor does the rest, and the
    lost actor is restarted on its node once the survivor is idle, to redo the lost task. Lost
    while the pool is still starting (its actor hangs in its constructor until the node goes), on
    a machine whose cores are all busy: the pool shrinks to the live node's actor, which does all."""
    files = sorted(media.iterdir())
    base = f"cluster/{lost}"  # the bucket is the module's: each case its own prefix
    s3.put([str(p) for p in files[:6]], f"{base}/media/")  # six as a folder, four as a WebDataset tar
    with tarfile.open(tmp_path / "rest.tar", "w") as tar:
        for i, p in enumerate(files[6:]):
            tar.add(p, arcname=f"{i:06d}{p.suffix}")
    s3.put(str(tmp_path / "rest.tar"), f"{base}/tars/rest.tar")
    named = {f"{i:06d}{p.suffix}": p.name for i, p in enumerate(files[6:])} | {p.name: p.name for p in files[:6]}
    c, doomed, marks = two_nodes(1, HANG if lost == "mid_task" else HANG_AT_START)
    if lost == "while_starting":  # once the nodes are up: Ray gives a raylet 30 s to start, fixed
        request.getfixturevalue("busy_cores")
    out, err = f"s3://{base}/out", tmp_path / "driver.err"
    roots = [f"s3://{base}/media", f"s3://{base}/tars/rest.tar"]
    ray = ["--engine", "ray", "--ray-address", c.address, "--workers", "0"]
    log = ["--log-file", tmp_path / "driver.log"]
    args = encode_argv(*roots, "-o", out, "--model", ckpt, *BASE, *ray, "--task-files", "2", *log)
    # the pool's progress lines every 5 s: a failure's stderr says what the driver was waiting for
    env = dict(os.environ, GEMMA4ENC_RAY_START_S=str(START_S), GEMMA4ENC_RAY_PROGRESS_S="5")
    code, stdout, in_flight = run_losing_a_node(c, doomed, marks, args, err, env)

    assert code == 0, said(err)
    summary = json.loads(stdout)
    assert summary["encoded"] == 10 and summary["ray_actors"] == 2, summary
    if lost == "mid_task":
        assert len(in_flight) == 2 and set(in_flight) <= set(named)
    else:
        assert in_flight == []  # the actor never held a task
    s3.invalidate_cache()
    parts = sorted(s3.find(f"{base}/out/manifest.parts"))
    rows = [json.loads(line) for p in parts for line in s3.cat_file(p).decode().splitlines()]
    assert sorted(named[Path(r["path"]).name] for r in rows) == sorted(p.name for p in files)  # once each
    assert all(r["status"] == "ok" for r in rows), rows
    emb = gemma4enc.open(out)
    want = {Path(p).name: t for p, t in local.items()}
    for path, _ in emb.ok_rows():
        assert torch.equal(emb[path], want[named[Path(path).name]]), path
    from gemma4enc.commands.app import app

    checked = RUN.invoke(app, ["verify", out])
    assert checked.exit_code == 0, checked.output

    again = encode([*roots, "-o", out, "--model", ckpt, *BASE, *ray])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["encoded"] == 0 and json.loads(again.stdout)["done_before"] == 10


def test_a_run_whose_actors_fit_on_no_node_left_stops_and_says_so(
    media, ckpt, local, two_nodes, tmp_path
):
    """One actor of 2 CPUs, which only the doomed node can hold: Ray would wait for room without
    end; the run stops (exit 2) once there has been none for GEMMA4ENC_RAY_ROOM_S, and resumes on a
    node added later."""
    c, doomed, marks = two_nodes(2)
    out, err = tmp_path / "out", tmp_path / "driver.err"
    ray = ["--engine", "ray", "--ray-address", c.address, "--workers", "1"]
    args = encode_argv(media, "-o", out, "--model", ckpt, *BASE, *ray, "--task-files", "2", "--log-file", tmp_path / "driver.log")
    env = dict(
        os.environ, GEMMA4ENC_RAY_START_S=str(START_S), GEMMA4ENC_RAY_ROOM_S="5", GEMMA4ENC_RAY_PROGRESS_S="1"
    )
    code, stdout, in_flight = run_losing_a_node(c, doomed, marks, args, err, env)

    assert code == 2, said(err)
    # while it waited, it said so: which round, what was up, and what it waited for
    assert "0 actor(s) up, 1 starting" in said(err) and "no live node has room for one" in said(err), said(err)
    assert (
        "no node left in the Ray cluster can hold an actor (2 CPU(s)) for 5 s"
        in json.loads(stdout)["error"]
    )
    rows = by_name(out) if (out / "manifest.jsonl").exists() else {}
    assert not set(in_flight) & set(rows)  # the lost task's files were left to the re-run

    refused = encode([media, "-o", out, "--model", ckpt, *BASE, *ray])  # still no room: told at once
    assert refused.exit_code == 2 and "the Ray cluster has 1" in refused.output, refused.output
    c.add_node(**node(2))  # room again (this node's workers do not hang)
    done = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done_before"] == len(rows)
    all_once_as_local(out, media, local)
