"""--engine ray on a real local Ray (loopback, 2 CPU actors): same embeddings as the local engine,
resume, bounded retries of actors that die, and fast, clear failures.

Float32 on both sides; tokens must match the local engine's within 1e-5 × their scale (the
actors run torch with their own thread count, so summation order may differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma4enc.errors import UsageError
from gemma4enc.media.discover import discover
from gemma4enc.options import Options

from .corpus import good_media
from .helpers import (
    BASE,
    by_name,
    close,
    encode,
    encode_argv,
    flags,
    ray_worker_hook,
    shard_tokens,
    verify,
)

pytest.importorskip("ray")
# every test here ends, or the run does; slow (a Ray cluster each): `make test-all` and CI run them
pytestmark = [pytest.mark.usefixtures("bounded"), pytest.mark.slow]

RAY = ["--engine", "ray", "--ray-actors", "2", "--workers", "0"]

# Makes a Ray worker die (os._exit) when it is about to encode always.jpg, every time, and when it is
# about to encode once.jpg the first time only: what the OOM killer or a segfault does to an actor.
KILLER = ray_worker_hook("G4E_TEST_MARKS", """
    for d in window:
        name = os.path.basename(d.item.path)
        mark = os.path.join(os.environ["G4E_TEST_MARKS"], name)
        if name == "always.jpg" or (name == "once.jpg" and not os.path.exists(mark)):
            open(mark, "a").write(f"{os.getpid()}\\n")
            os._exit(1)
    return encode(window, *args, **kwargs)
""")


# Makes a Ray worker raise where G4E_TEST_RAISE is set: an error on fails.jpg (its task is then tried
# file by file, and fails.jpg alone is recorded as failed), and, where G4E_TEST_OUTPUT is set too,
# OUT stopping taking writes on every window.
RAISER = ray_worker_hook("G4E_TEST_RAISE", """
    from gemma4enc.errors import OutputError
    if os.environ.get("G4E_TEST_OUTPUT"):
        raise OutputError("cannot write on cue")
    if any(os.path.basename(d.item.path) == "fails.jpg" for d in window):
        raise RuntimeError("on cue")
    return encode(window, *args, **kwargs)
""")

@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = good_media(tmp_path_factory.mktemp("ray") / "media")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 100)
    return root


@pytest.fixture(scope="module")
def local(media, ckpt, tmp_path_factory):
    """The local engine's tokens: what Ray must reproduce."""
    out = tmp_path_factory.mktemp("local") / "out"
    result = encode([media, "-o", out, "--model", ckpt, *BASE])
    assert result.exit_code == 1, result.output  # broken.jpg
    return shard_tokens(out)[1]


def same_tokens(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for path, t in got.items():
        assert t.shape == want[path].shape and close(t, want[path], 1e-5), path


def test_ray_equals_local_and_resumes_what_is_left(media, ckpt, local, tmp_path):
    out = tmp_path / "out"
    files = sorted(str(p) for p in media.iterdir())
    started = [f for f in files if "photo" in f][:3]
    first = encode([*started, "-o", out, "--model", ckpt, *BASE])  # the local engine starts the folder
    assert first.exit_code == 0, first.output

    result = encode([media, "-o", out, "--model", ckpt, *BASE, *RAY, "--task-files", "2"])
    assert result.exit_code == 1, result.output  # broken.jpg
    summary = json.loads(result.stdout)  # stdout stays pure JSON although Ray prints on it
    assert summary["engine"] == "ray" and summary["ray_actors"] == 2 and summary["ray_address"] == "local"
    assert summary["done_before"] == 3 and summary["encoded"] + summary["failed"] == len(files) - 3
    assert by_name(out)["broken.jpg"]["status"] == "decode_error"
    same_tokens(shard_tokens(out)[1], local)

    # each task's shard is named from its files: the names the driver can compute again
    items, _ = discover([str(media)], None, [], [], False)
    from gemma4enc.run.ray.actor import make_tasks

    tasks = {t["id"]: t for t in make_tasks([i for i in items if i.path not in started], 2)}
    ray_shards = {p.name for p in out.glob("shard-*-000.safetensors")}
    assert ray_shards and {n.split("-")[1] for n in ray_shards} <= set(tasks)
    report = verify(out)
    assert report["ok"] and not report["warnings"], report

    orphan = out / "shard-0123456789abcdef-000.safetensors"  # what a driver killed mid-task leaves
    orphan.write_bytes((out / sorted(ray_shards)[0]).read_bytes())
    again = encode([media, "-o", out, "--model", ckpt, *BASE, *RAY, "--retry-failed"])
    assert json.loads(again.stdout)["encoded"] == 0 and json.loads(again.stdout)["by_status"] == {"decode_error": 1}
    nothing = encode([media, "-o", out, "--model", ckpt, *BASE, *RAY])
    assert nothing.exit_code == 0 and json.loads(nothing.stdout)["done_before"] == len(files)
    assert "ray_actors" not in json.loads(nothing.stdout)  # nothing to do: Ray was not started
    assert not orphan.exists() and verify(out)["ok"]  # (no clock: "encoded == 0" says nothing was redone)


def test_a_dying_worker_is_retried_and_a_file_that_always_kills_it_is_recorded(media, ckpt, local, tmp_path,
                                                                                monkeypatch):
    work = tmp_path / "media"
    work.mkdir()
    for p in media.iterdir():
        (work / p.name).write_bytes(p.read_bytes())
    (work / "always.jpg").write_bytes((media / "photo0.jpg").read_bytes())
    (work / "once.jpg").write_bytes((media / "photo1.jpg").read_bytes())
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir(), marks.mkdir()
    (hook / "sitecustomize.py").write_text(KILLER)
    monkeypatch.setenv("PYTHONPATH", f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("G4E_TEST_MARKS", str(marks))

    out = tmp_path / "out"
    result = encode([work, "-o", out, "--model", ckpt, *BASE, *RAY, "--task-files", "3"])
    assert result.exit_code == 1, result.output
    rows = by_name(out)
    assert rows["always.jpg"]["status"] == "worker_died" and "died 3 times" in rows["always.jpg"]["error"]
    assert rows["once.jpg"]["status"] == "ok" and rows["broken.jpg"]["status"] == "decode_error"
    assert len((marks / "once.jpg").read_text().split()) == 1  # killed once, then retried and done
    assert len((marks / "always.jpg").read_text().split()) == 6  # 3 tries in its task, 3 alone: bounded
    assert set(rows) == {p.name for p in work.iterdir()}  # no file lost with its task
    tokens = shard_tokens(out)[1]
    renamed = {str(media / Path(p).name): t for p, t in tokens.items() if Path(p).name != "once.jpg"}
    same_tokens(renamed, local)
    assert close(tokens[str(work / "once.jpg")], local[str(media / "photo1.jpg")], 1e-5)
    report = verify(out)
    assert report["ok"] and not report["warnings"], report  # the dead tasks' shards were removed


def test_an_actors_error_is_told_by_its_kind(media, ckpt, tmp_path, monkeypatch):
    """A task that raised is tried file by file, and the file that raises alone is an `error` row
    with the reason, its task's other files saved; OUT that stops taking writes in an actor stops
    the whole run (exit 4) with the actor's message, and nothing more is recorded."""
    work = tmp_path / "media"
    work.mkdir()
    for p in media.iterdir():
        (work / p.name).write_bytes(p.read_bytes())
    (work / "fails.jpg").write_bytes((media / "photo0.jpg").read_bytes())
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RAISER)
    monkeypatch.setenv("PYTHONPATH", f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("G4E_TEST_RAISE", "1")

    out = tmp_path / "out"
    result = encode([work, "-o", out, "--model", ckpt, *BASE, *RAY, "--task-files", "3"])
    assert result.exit_code == 1, result.output
    rows = by_name(out)
    assert rows["fails.jpg"]["status"] == "error" and rows["fails.jpg"]["error"] == "RuntimeError: on cue"
    assert rows["broken.jpg"]["status"] == "decode_error"
    assert set(rows) == {p.name for p in work.iterdir()}  # no file lost with its task
    assert all(r["status"] == "ok" for name, r in rows.items() if name not in ("fails.jpg", "broken.jpg"))
    report = verify(out)
    assert report["ok"] and not report["warnings"], report  # the failed task's shards were removed

    (work / "new.jpg").write_bytes((media / "photo1.jpg").read_bytes())
    monkeypatch.setenv("G4E_TEST_OUTPUT", "1")
    stopped = encode([work, "-o", out, "--model", ckpt, *BASE, *RAY])
    assert stopped.exit_code == 4 and "cannot write on cue" in stopped.output, stopped.output
    assert "new.jpg" not in by_name(out) and verify(out)["ok"]

def test_unreachable_cluster_and_too_few_resources_fail_fast(media, ckpt, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = encode([media, "-o", tmp_path / "a", "--model", ckpt, *BASE, "--engine", "ray",
                     "--ray-address", f"127.0.0.1:{port}"])
    # refused by our own probe (seconds at most), before Ray's minutes of reconnecting
    assert result.exit_code == 2, result.output
    assert f"the Ray cluster at 127.0.0.1:{port} cannot be reached (Connection refused)" in result.output

    result = encode([media, "-o", tmp_path / "b", "--model", ckpt, *flags(device="cuda"), "--engine", "ray"])
    assert result.exit_code == 2 and "the Ray cluster has 0" in result.output, result.output
    assert not list((tmp_path / "b").glob("*.safetensors"))

    result = encode([media, "-o", tmp_path / "c", "--model", ckpt, "--engine", "ray", "--ray-address", "x"])
    assert result.exit_code == 2 and "HOST:PORT" in result.output
    result = encode([media, "-o", tmp_path / "d", "--model", ckpt, "--ray-actors", "2"])
    assert result.exit_code == 2 and "need --engine ray" in result.output


def _ray_processes(marker: str) -> list[int]:
    """The pids of the processes whose command line names `marker` (this test's own Ray folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def _auto(media, ckpt, out, env, timeout=120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    run = subprocess.run(encode_argv(media, "-o", out, "--model", ckpt, *flags(json=False), "--engine", "ray",
                                     "--ray-address", "auto"), capture_output=True, text=True, env=env,
                         timeout=timeout)
    return run, time.monotonic() - start


def test_auto_where_the_last_cluster_died_or_froze_says_so_in_seconds(media, ckpt, tmp_path):
    """`ray start --head`, then the head frozen (SIGSTOP) and killed (SIGKILL, its record left in
    Ray's temp folder): `--ray-address auto` ends each time in seconds, exit 2, one line saying
    what it found, where Ray's own connect waits in its GCS client for as long as one waits. A Ray
    folder of this test's own (RAY_TMPDIR, short: Ray's sockets live in it), so what other Ray
    clusters on the machine live or died changes nothing."""
    import shutil
    import signal
    import tempfile

    from gemma4enc.run.ray.cluster import probe

    folder = tempfile.mkdtemp(prefix="g4e-t-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RAY_TMPDIR": folder, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    try:
        refused, took = _auto(media, ckpt, tmp_path / "none", env)  # nothing recorded: told at once
        assert refused.returncode == 2 and took < 60, refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"gemma4enc: error: --ray-address auto: no Ray cluster is recorded on this machine ({folder}/ray/"
            "ray_current_cluster is absent) and RAY_ADDRESS is not set; start one with `ray start --head`, "
            "give HOST:PORT, or leave out --ray-address for a private Ray"], refused.stderr

        ray_cli = Path(sys.executable).with_name("ray")
        started = subprocess.run([ray_cli, "start", "--head", "--port=0", "--num-cpus=1", "--include-dashboard=false",
                                  "--disable-usage-stats"], capture_output=True, text=True, env=env, timeout=300)
        assert started.returncode == 0, started.stderr
        address = (Path(folder) / "ray" / "ray_current_cluster").read_text().strip()
        probe(address, "the test's cluster", "")  # alive: it answers as a GCS does
        gcs = [p for p in _ray_processes(folder) if b"gcs_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(gcs) == 1

        os.kill(gcs[0], signal.SIGSTOP)  # frozen: the kernel still takes the connection
        frozen, took = _auto(media, ckpt, tmp_path / "frozen", env | {"GEMMA4ENC_RAY_PROBE_S": "3"})
        assert frozen.returncode == 2 and took < 60, frozen.stderr
        assert frozen.stderr.strip().splitlines() == [
            f"gemma4enc: error: --ray-address auto: the Ray cluster recorded in {folder}/ray/ray_current_cluster at "
            f"{address} did not answer in 3 s (a frozen or overloaded head node?); set GEMMA4ENC_RAY_PROBE_S "
            "to wait longer, or leave out --ray-address for a private Ray"], frozen.stderr

        for pid in _ray_processes(folder):  # died uncleanly: its record stays
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _ray_processes(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        dead, took = _auto(media, ckpt, tmp_path / "dead", env)
        assert dead.returncode == 2 and took < 60, dead.stderr
        assert dead.stderr.strip().splitlines() == [
            f"gemma4enc: error: --ray-address auto: the Ray cluster recorded in {folder}/ray/ray_current_cluster at "
            f"{address} cannot be reached (Connection refused); the cluster has stopped and its record "
            "outlived it; start one with `ray start --head`, give HOST:PORT, or leave out --ray-address "
            "for a private Ray"], dead.stderr
        for name in ("none", "frozen", "dead"):  # nothing encoded, nothing recorded
            manifest = tmp_path / name / "manifest.jsonl"
            assert not list((tmp_path / name).glob("*.safetensors"))
            assert not manifest.exists() or not manifest.read_text().strip()
    finally:
        for pid in _ray_processes(folder):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_listener_that_is_not_ray_is_told_apart():
    """A port where something else listens (it reads and answers, but not as gRPC)."""
    import socket
    import threading

    from gemma4enc.run.ray.cluster import probe

    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.recv(100)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    port = server.getsockname()[1]
    with server, pytest.raises(UsageError, match=f"something listens at 127.0.0.1:{port}, but it is not a Ray"):
        probe(f"127.0.0.1:{port}", "the Ray cluster", "check the address")


def test_auto_follows_ray_address_and_probes_it(monkeypatch):
    """RAY_ADDRESS (as `ray job submit` sets it) is what auto joins: probed like any address."""
    import socket

    from gemma4enc.run.ray.cluster import check_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(UsageError, match=f"the Ray cluster RAY_ADDRESS names at 127.0.0.1:{port} cannot be "
                                         r"reached \(Connection refused\); check RAY_ADDRESS"):
        check_address("auto")
    monkeypatch.setenv("RAY_ADDRESS", "nonsense")
    with pytest.raises(UsageError, match="RAY_ADDRESS: use auto or HOST:PORT, not 'nonsense'"):
        check_address("auto")


def test_pool_sizes_from_the_cluster():
    from gemma4enc.run.ray.cluster import plan_pool

    def ray(**kw):  # the pool is planned for --engine ray, which Options now requires of --ray-actors
        return Options(engine="ray", **kw)

    gpu = plan_pool({"GPU": 4, "CPU": 32}, ray())
    assert (gpu.actors, gpu.gpus, gpu.cpus, gpu.device) == (4, 1, 8, "cuda")  # 7 decode workers each
    assert plan_pool({"GPU": 4, "CPU": 32}, ray(ray_actors=2, workers=3)).cpus == 4
    cpu = plan_pool({"GPU": 4, "CPU": 6}, ray(device="cpu", workers=1))
    assert (cpu.actors, cpu.gpus, cpu.cpus, cpu.device) == (3, 0, 2, "cpu")
    with pytest.raises(UsageError, match="the Ray cluster has 4"):
        plan_pool({"GPU": 4, "CPU": 64}, ray(ray_actors=5))
    with pytest.raises(UsageError, match="need 6 CPUs"):
        plan_pool({"CPU": 4}, ray(device="cpu", ray_actors=3, workers=1))
    with pytest.raises(UsageError, match="--device auto, cuda or cpu"):
        plan_pool({"GPU": 2, "CPU": 8}, ray(device="cuda:1"))


def test_a_private_ray_listens_on_loopback_only_without_dashboard_or_usage_stats():
    from gemma4enc.run.ray.cluster import connect

    def listening() -> set[str]:
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    found.add(local)
        return found

    before = listening()
    with connect(None) as ray:
        new = listening() - before
        from ray._common.usage import usage_lib

        assert not usage_lib.usage_stats_enabled()
        assert ray.is_initialized()
    assert new, "Ray opened no listening socket?"
    loopback = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")  # 127.0.0.1, ::1, ::ffff:127.0.0.1
    assert all(addr.startswith(loopback) for addr in new), new
    assert not any(addr.endswith(":2031") for addr in new)  # 8265, the dashboard's port


def test_the_local_engine_does_not_import_ray(media, ckpt, tmp_path):
    code = ("import sys; from typer.testing import CliRunner; from gemma4enc.commands.cli import app; "
            f"r = CliRunner().invoke(app, ['encode', {str(media / 'photo0.jpg')!r}, '-o', {str(tmp_path / 'o')!r}, "
            f"'--model', {str(ckpt)!r}, '--device', 'cpu', '-q']); "
            "assert r.exit_code == 0, r.output; assert 'ray' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr


def test_a_killed_driver_resumes_on_ray_to_the_same_result(media, ckpt, local, tmp_path):
    """kill -9 of the driver once rows have landed, then the same command: every file once, tokens as local."""
    out = tmp_path / "out"
    args = encode_argv(media, "-o", out, "--model", ckpt, *flags(json=False), *RAY, "--task-files", "1")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (
            (out / "manifest.jsonl").exists() and (out / "manifest.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    cut_short = len(by_name(out)) < len(list(media.iterdir()))
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr  # 1 when broken.jpg was left to this run
    rows = by_name(out)  # never a file twice
    assert set(rows) == {p.name for p in media.iterdir()} and cut_short
    assert rows["broken.jpg"]["status"] == "decode_error"
    same_tokens(shard_tokens(out)[1], local)
    report = verify(out)
    assert report["ok"] and not report["warnings"], report


def test_the_private_rays_folder_is_reached_by_no_other_user():
    """Ray makes its temp folder 0777 without the sticky bit (any local user could replace its
    sockets and session files); the private Ray's lives inside a 0700 folder of gemma4enc's, so no
    folder on the way to it is open to other users, and it is gone afterwards."""
    import stat
    import tempfile

    from gemma4enc.run.ray.cluster import _connected

    with _connected(None) as ray:
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        top = Path(tempfile.gettempdir())
        chain = [p for p in [session, *session.parents] if p != top and top in p.parents]
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in chain}
        ours = [p for p in chain if p.name.startswith("g4e-ray-")]
        assert len(ours) == 1 and modes[ours[0]] == 0o700, modes
        assert all(m & 0o022 == 0 or m & stat.S_ISVTX for p, m in modes.items() if p in ours[0].parents or p == ours[0])
    assert not ours[0].exists()
