"""OUT by URL (-o s3://bucket/prefix) against an S3 server on loopback (moto's server mode), read
and written through s3fs as users run it: tokens equal a local OUT's, a re-run encodes nothing,
the manifest is parts that compact merges, the lock is a conditional create, a kill resumes, and
the readers and exports work on the URL."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

import gemma4enc
from gemma4enc.commands.app import app

from .helpers import BASE, RUN, encode, encode_argv, flags, loopback_s3, shard_tokens

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "out-bucket"


@pytest.fixture(scope="module")
def s3():
    """A loopback S3 (moto) for this module, found by s3fs through the usual AWS_* variables."""
    with loopback_s3(BUCKET) as (fs, _):
        yield fs


@pytest.fixture(scope="module")
def local(good, ckpt, tmp_path_factory):
    """The same files encoded into a local OUT: what every URL OUT must hold."""
    out = tmp_path_factory.mktemp("local") / "out"
    assert encode([good, "-o", out, "--model", ckpt, *BASE, "--workers", "0"]).exit_code == 0
    rows, tokens = shard_tokens(out)
    return {Path(p).name: t for p, t in tokens.items()}


def _cli(*args) -> tuple[int, str]:
    result = RUN.invoke(app, list(map(str, args)))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output + (result.stderr or "")


def _summary(output: str) -> dict:
    return json.JSONDecoder().raw_decode(output[output.index("{"):])[0]


def _tokens(url: str) -> dict:
    """File name → tokens, read back through gemma4enc.open on the URL."""
    emb = gemma4enc.open(url)
    return {Path(p).name: emb[p] for p, _ in emb.ok_rows()}


def _objects(s3, prefix: str) -> list[str]:
    s3.invalidate_cache()  # what the store holds now, not this process's listing of it
    return sorted(p[len(prefix) + 1:] for p in s3.find(prefix))


def _latest_rows(s3, prefix: str) -> list[dict]:
    """Every row the store's manifest holds (base, then parts in order), read with s3fs and json only."""
    names = _objects(s3, prefix)
    parts = sorted(n for n in names if n.startswith("manifest.parts/"))
    blobs = ([s3.cat_file(f"{prefix}/manifest.jsonl")] if "manifest.jsonl" in names else []) + [
        s3.cat_file(f"{prefix}/{n}") for n in parts]
    return [json.loads(line) for blob in blobs for line in blob.decode().splitlines()]


def test_an_s3_out_holds_what_a_local_out_does_and_a_rerun_encodes_nothing(s3, good, ckpt, local):
    url = f"s3://{BUCKET}/runs/first"
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0", "--json")
    assert code == 0, output
    report = _summary(output)
    assert report["out"] == url and report["encoded"] == 6
    names = _objects(s3, f"{BUCKET}/runs/first")
    assert "settings.json" in names and "gemma4enc.lock" not in names
    assert any(n.startswith("shard-") for n in names)
    assert [n for n in names if n.startswith("manifest.parts/")], names  # rows as parts, no base yet
    rows = _latest_rows(s3, f"{BUCKET}/runs/first")
    assert sorted(Path(r["path"]).name for r in rows) == sorted(local)  # every file once
    got = _tokens(url)
    assert set(got) == set(local)
    for name, t in got.items():
        assert torch.equal(t, local[name]), name
    code, output = _cli("verify", url, "--json")
    assert code == 0 and _summary(output)["ok"], output
    code, output = _cli("inspect", url, "--json")
    assert code == 0 and _summary(output)["files"] == 6 and _summary(output)["out"] == url, output
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0", "--json")
    assert code == 0 and (_summary(output)["encoded"], _summary(output)["done_before"]) == (0, 6), output
    code, output = _cli("plan", good, "-o", url, "--json")  # planned against the store's manifest
    assert code == 0 and _summary(output)["done_before"] == 6, output
    code, output = _cli("search", url, good / "photo0.jpg", "-k", "2", "--json")
    assert code == 0, output
    hits = _summary(output)["results"][0]["hits"]
    assert hits[0]["path"] == str(good / "photo0.jpg") and hits[0]["score"] > 0.999, hits


def test_verify_repair_encodes_again_the_files_of_a_shard_gone_from_the_store(s3, good, ckpt, local, tmp_path):
    url, prefix = f"s3://{BUCKET}/runs/repair", f"{BUCKET}/runs/repair"
    good = shutil.copytree(good, tmp_path / "media", copy_function=shutil.copy2)  # a copy: it moves below
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0",
                        "--flush-seconds", "0")
    assert code == 0, output
    gone = sorted(n for n in _objects(s3, prefix) if n.startswith("shard-"))[0]
    s3.rm_file(f"{prefix}/{gone}")
    code, output = _cli("verify", url, "--json")
    assert code == 1 and gone in _summary(output)["missing_shards"], output
    code, output = _cli("verify", url, "--repair", "--json")
    assert code == 0 and _summary(output)["ok"] and _summary(output)["repaired"] >= 1, output
    latest = {r["path"]: r for r in _latest_rows(s3, prefix)}
    assert sorted(Path(p).name for p in latest) == sorted(local)
    assert all(r["status"] == "ok" for r in latest.values())
    # the repaired rows keep where each file sat: a moved folder is recognised, exports say rel
    assert all((r["root"], r["rel"]) == (str(good), Path(p).name) for p, r in latest.items()), latest
    got = _tokens(url)
    assert set(got) == set(local) and all(torch.equal(t, local[n]) for n, t in got.items())
    moved = shutil.move(good, tmp_path / "moved")  # a rename keeps the mtimes
    code, output = _cli("encode", moved, "-o", url, "--model", ckpt, *BASE, "--workers", "0", "--json")
    assert code == 0 and _summary(output)["encoded"] == 0, output
    code, output = _cli("export", url, tmp_path / "pq", "--to", "parquet")
    assert code == 0, output
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(tmp_path / "pq" / "data").to_pylist()
    assert {(r["path"], r["rel"]) for r in table if r["path"].startswith(str(moved))} == {
        (str(Path(moved) / n), n) for n in local}


def test_compact_merges_the_parts_into_one_manifest(s3, good, ckpt, local, tmp_path):
    url = f"s3://{BUCKET}/runs/compact"
    files = sorted(good.iterdir())
    for f in files[:3], files[3:]:  # two runs: two sets of parts
        code, output = _cli("encode", *f, "-o", url, "--model", ckpt, *BASE, "--workers", "0")
        assert code == 0, output
    prefix = f"{BUCKET}/runs/compact"
    assert len([n for n in _objects(s3, prefix) if n.startswith("manifest.parts/")]) >= 2
    code, output = _cli("compact", url, "--json")
    assert code == 0, output
    names = _objects(s3, prefix)
    assert not [n for n in names if n.startswith("manifest.parts/")], names
    rows = [json.loads(line) for line in s3.cat(f"{prefix}/manifest.jsonl").decode().splitlines()]
    assert sorted(Path(r["path"]).name for r in rows) == sorted(local)
    got = _tokens(url)
    assert all(torch.equal(t, local[n]) for n, t in got.items()) and set(got) == set(local)
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0", "--json")
    assert code == 0 and _summary(output)["encoded"] == 0, output
    # the exports read the URL too; pyarrow reads what they wrote
    pq = pytest.importorskip("pyarrow.parquet")
    code, output = _cli("export", url, tmp_path / "pq", "--to", "parquet", "--dtype", "float32")
    assert code == 0, output
    paths = [p for f in sorted((tmp_path / "pq" / "data").glob("*.parquet"))
             for p in pq.read_table(f, columns=["path"]).column("path").to_pylist()]
    assert sorted(Path(p).name for p in paths) == sorted(local)


def test_the_lock_is_a_conditional_create_held_by_one_run(s3, good, ckpt):
    url, prefix = f"s3://{BUCKET}/runs/locked", f"{BUCKET}/runs/locked"
    # a live run elsewhere: refused, nothing written
    holder = {"pid": 1, "host": "elsewhere", "started": "now", "token": "x", "renewed": time.time()}
    s3.pipe(f"{prefix}/gemma4enc.lock", json.dumps(holder).encode())
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0")
    assert code == 2 and "in use by another gemma4enc run" in output and "elsewhere" in output, output
    assert _objects(s3, prefix) == ["gemma4enc.lock"]
    # a run of this host that is gone: taken over, said so
    dead = subprocess.Popen(["true"])
    dead.wait()
    holder |= {"pid": dead.pid, "host": socket.gethostname()}
    s3.pipe(f"{prefix}/gemma4enc.lock", json.dumps(holder).encode())
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *flags(quiet=False), "--workers", "0")
    assert code == 0 and "took over the lock" in output, output
    assert "gemma4enc.lock" not in _objects(s3, prefix)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_result(s3, good, ckpt, local, tmp_path):
    """kill -9 once the first part is in the store (a shard and its part per file): the next run
    marks nothing twice, encodes only what is missing, and the store reads as a whole run's."""
    media = tmp_path / "media"  # four copies of the six files: a run long enough to be cut short
    for copy in range(4):
        for f in good.iterdir():
            (media / f"c{copy}").mkdir(parents=True, exist_ok=True)
            (media / f"c{copy}" / f.name).write_bytes(f.read_bytes())
    url, prefix = f"s3://{BUCKET}/runs/killed", f"{BUCKET}/runs/killed"
    args = ["-o", url, "--model", ckpt, *BASE, "--workers", "0", "--flush-seconds", "0"]
    proc = subprocess.Popen(encode_argv(media, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if any(n.startswith("manifest.parts/") for n in _objects(s3, prefix)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    before = len(_latest_rows(s3, prefix))
    assert 0 < before < 24 and "gemma4enc.lock" in _objects(s3, prefix)
    code, output = _cli("encode", media, *args, "--json")
    assert code == 0, output
    assert (_summary(output)["done_before"], _summary(output)["encoded"]) == (before, 24 - before)
    rows = _latest_rows(s3, prefix)
    assert len({r["path"] for r in rows}) == 24 and len(rows) == 24  # every file once, none twice
    emb = gemma4enc.open(url)
    for path, _ in emb.ok_rows():
        assert torch.equal(emb[path], local[Path(path).name]), path
    code, output = _cli("verify", url)
    assert code == 0, output


def test_the_holder_renews_its_lock_and_stops_once_another_run_took_it(s3, monkeypatch):
    from gemma4enc.errors import OutputError
    from gemma4enc.output import store

    monkeypatch.setattr(store, "RENEW_S", 0.1)
    prefix = f"{BUCKET}/runs/renewed"
    lock = store.StoreLock(store.Store(f"s3://{prefix}")).acquire()
    try:
        first = json.loads(s3.cat_file(f"{prefix}/gemma4enc.lock"))
        deadline = time.monotonic() + 30
        while json.loads(s3.cat_file(f"{prefix}/gemma4enc.lock"))["renewed"] == first["renewed"]:
            assert time.monotonic() < deadline, "the lock was not renewed"
            time.sleep(0.05)
        lock.check()  # still ours
        # another run found it stale and took it: this one must stop before writing more
        s3.pipe(f"{prefix}/gemma4enc.lock", json.dumps(first | {"token": "theirs"}).encode())
        while not lock.lost:
            assert time.monotonic() < deadline, "the takeover was not noticed"
            time.sleep(0.05)
        with pytest.raises(OutputError, match="took over OUT's lock"):
            lock.check()
    finally:
        lock.release()
    assert json.loads(s3.cat_file(f"{prefix}/gemma4enc.lock"))["token"] == "theirs"  # not ours to remove


def test_a_lock_not_renewed_for_ten_minutes_is_taken_over(s3):
    from gemma4enc.output import store

    prefix = f"{BUCKET}/runs/stale"
    old = {"pid": 1, "host": "elsewhere", "started": "then", "token": "t",
           "renewed": time.time() - store.STALE_S - 5}
    s3.pipe(f"{prefix}/gemma4enc.lock", json.dumps(old).encode())
    lock = store.StoreLock(store.Store(f"s3://{prefix}")).acquire()
    try:
        assert lock.previous["token"] == "t"
        assert json.loads(s3.cat_file(f"{prefix}/gemma4enc.lock"))["token"] == lock.me["token"]
    finally:
        lock.release()
    s3.invalidate_cache()
    assert not s3.exists(f"{prefix}/gemma4enc.lock")


def test_a_bucket_that_is_not_there_is_one_line_and_exit_2(s3, good, ckpt):
    code, output = _cli("encode", good, "-o", "s3://no-such-bucket/out", "--model", ckpt, *BASE)
    assert code == 2 and "no such bucket" in output and "Traceback" not in output, output
    code, output = _cli("inspect", f"s3://{BUCKET}/never-written")
    assert code == 2 and "no manifest.jsonl" in output and f"s3://{BUCKET}/never-written" in output, output


def test_a_run_merges_the_parts_once_they_pile_up(s3, good, ckpt, local, monkeypatch):
    from gemma4enc.output import out

    monkeypatch.setattr(out, "AUTO_PARTS", 3)
    url, prefix = f"s3://{BUCKET}/runs/piled", f"{BUCKET}/runs/piled"
    code, output = _cli("encode", good, "-o", url, "--model", ckpt, *flags(quiet=False), "--workers", "0",
                        "--flush-seconds", "0")  # a shard and a part per file: six parts
    assert code == 0 and "merged 6 manifest parts" in output, output
    names = _objects(s3, prefix)
    assert not [n for n in names if n.startswith("manifest.parts/")], names
    rows = [json.loads(line) for line in s3.cat_file(f"{prefix}/manifest.jsonl").decode().splitlines()]
    assert sorted(Path(r["path"]).name for r in rows) == sorted(local)
    got = _tokens(url)
    assert set(got) == set(local) and all(torch.equal(t, local[n]) for n, t in got.items())


def test_compact_prune_on_a_store_rewrites_the_shard_without_the_gone_file(s3, good, ckpt, local, tmp_path):
    url, prefix = f"s3://{BUCKET}/runs/prune", f"{BUCKET}/runs/prune"
    media = tmp_path / "media"
    media.mkdir()
    for name in ("photo0.jpg", "small.png", "clip.mp4"):
        (media / name).write_bytes((good / name).read_bytes())
    code, output = _cli("encode", media, "-o", url, "--model", ckpt, *BASE, "--workers", "0")
    assert code == 0, output
    before = [n for n in _objects(s3, prefix) if n.startswith("shard-")]
    (media / "small.png").unlink()
    code, output = _cli("compact", url, "--prune", "--json")
    assert code == 0 and _summary(output)["pruned"] == 1 and _summary(output)["shards_rewritten"] == 1, output
    after = [n for n in _objects(s3, prefix) if n.startswith("shard-")]
    assert len(after) == 1 and after != before  # the copy without it replaced the old shard
    got = _tokens(url)
    assert sorted(got) == ["clip.mp4", "photo0.jpg"]
    assert all(torch.equal(t, local[n]) for n, t in got.items())
    code, output = _cli("verify", url)
    assert code == 0, output


def test_files_from_takes_a_list_kept_in_the_store(s3, good, ckpt, tmp_path):
    """--files-from s3://…: the list beside the data is read through the store, as OUT and ROOTS are;
    a list that is not there is one line, exit 2, and nothing is made locally."""
    for name in ("photo0.jpg", "small.png"):
        s3.put(str(good / name), f"{BUCKET}/listed/{name}")
    s3.pipe(f"{BUCKET}/listed/list.txt", "".join(f"s3://{BUCKET}/listed/{n}\n" for n in ("photo0.jpg",
                                                                                         "small.png")).encode())
    out = tmp_path / "out"
    code, output = _cli("encode", "--files-from", f"s3://{BUCKET}/listed/list.txt", "-o", out, "--model", ckpt,
                        *BASE, "--workers", "0")
    assert code == 0 and _summary(output)["encoded"] == 2, output
    code, output = _cli("plan", "--files-from", f"s3://{BUCKET}/listed/list.txt", "-o", out, "--json")
    assert code == 0 and _summary(output)["done_before"] == 2, output
    code, output = _cli("encode", "--files-from", f"s3://{BUCKET}/listed/nope.txt", "-o", tmp_path / "o2",
                        "--model", ckpt, *BASE)
    assert code == 2 and f"--files-from s3://{BUCKET}/listed/nope.txt" in output, output
    assert not (tmp_path / "o2").exists()


def test_missing_or_refused_keys_and_a_dead_endpoint_are_one_line_and_exit_2(s3, good, ckpt, tmp_path,
                                                                              monkeypatch):
    """No keys, keys the store does not know, an endpoint nothing listens on: each command that
    reads or writes the store ends at once with exit 2 and one line naming what to set, and
    makes nothing locally (no retries: none would mend them)."""
    import moto.settings

    url = f"s3://{BUCKET}/keys/out"
    code, output = _cli("encode", good / "small.png", "-o", url, "--model", ckpt, *BASE, "--workers", "0")
    assert code == 0, output
    s3.put(str(good / "small.png"), f"{BUCKET}/keys/media/small.png")
    monkeypatch.chdir(tmp_path)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))  # the machine's own keys stay out of it
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{free.getsockname()[1]}"  # closed again: nothing listens there
    commands = {
        "encode -o URL": ["encode", good / "small.png", "-o", f"s3://{BUCKET}/keys/new", "--model", ckpt, *BASE],
        "encode URL": ["encode", f"s3://{BUCKET}/keys/media", "-o", tmp_path / "o", "--model", ckpt, *BASE],
        "inspect": ["inspect", url], "verify": ["verify", url], "export": ["export", url, tmp_path / "x"],
        "search": ["search", url, "--duplicates"], "compact": ["compact", url],
        "plan -o URL": ["plan", good / "small.png", "-o", url],
    }
    cases = [
        ("no keys", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, False,
         "no credentials for s3:// were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        ("a dead endpoint", {"AWS_ENDPOINT_URL": dead}, False, f"cannot reach the store at {dead}"),
        ("wrong keys", {"AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong"}, True,
         "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ]
    for case, env, auth, says in cases:
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.delenv(k) if v is None else mp.setenv(k, v)
            if auth:  # moto checks keys only when told to; then it knows none but those IAM made
                mp.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
            for command, args in commands.items():
                s3fs.S3FileSystem.clear_instance_cache()  # clients made with the case's environment
                start = time.monotonic()
                result = RUN.invoke(app, list(map(str, args)))
                took = time.monotonic() - start
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert result.exit_code == 2 and len(lines) == 1, (case, command, result.output)
                assert says in lines[0] and "Traceback" not in result.output, (case, command, lines)
                assert took < 15, (case, command, took)  # told at once, not after rounds of retries
    s3fs.S3FileSystem.clear_instance_cache()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["none"] or not list(tmp_path.iterdir())


def test_export_to_a_url_uploads_the_export_and_refuses_a_prefix_in_use(s3, good, ckpt, local, tmp_path):
    """export OUT s3://…: the same files as a local export, uploaded (export.json last); a prefix that
    holds anything is refused without --overwrite, which replaces only what an export wrote."""
    pq = pytest.importorskip("pyarrow.parquet")
    url = f"s3://{BUCKET}/runs/first"  # the first test's OUT (or made here when run alone)
    if not s3.exists(f"{BUCKET}/runs/first/settings.json"):
        assert _cli("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0")[0] == 0
    dest, prefix = f"s3://{BUCKET}/exports/clip", f"{BUCKET}/exports/clip"
    code, output = _cli("export", url, dest, "--to", "clip", "--json")
    assert code == 0, output
    report = _summary(output)
    assert report["dir"] == dest and report["rows"] == 6 and report["source"] == url
    assert _objects(s3, prefix) == sorted([*report["files"], "export.json"])
    with s3.open(f"{prefix}/metadata/metadata_0.parquet", "rb") as f:
        paths = pq.read_table(f).column("path").to_pylist()
    assert sorted(Path(p).name for p in paths) == sorted(local)
    s3.pipe(f"{prefix}/notes.txt", b"mine")
    code, output = _cli("export", url, dest, "--to", "parquet")
    assert code == 2 and "is not empty" in output, output
    code, output = _cli("export", url, dest, "--to", "parquet", "--overwrite")
    assert code == 0, output
    assert _objects(s3, prefix) == ["data/train-00000.parquet", "export.json", "notes.txt"]
    assert not list(Path(".").glob("s3:*"))


def test_a_huge_settings_object_in_the_store_is_refused_not_fetched(s3, good, ckpt, monkeypatch):
    """A handed-over bucket whose settings.json is 2 MiB: the listing's size says it is no file
    gemma4enc writes, and every command ends in one line (exit 2), not fetching it whole."""
    from gemma4enc.output.store import Store

    fetched = []
    read = Store.read
    monkeypatch.setattr(Store, "read", lambda self, name: fetched.append(name) or read(self, name))
    url = f"s3://{BUCKET}/huge-settings"
    s3.pipe_file(f"{BUCKET}/huge-settings/settings.json", b'{"model": "' + b"m" * (2 << 20) + b'"}')
    s3.pipe_file(f"{BUCKET}/huge-settings/manifest.jsonl", b"")
    for args in (("encode", good, "-o", url, "--model", ckpt, *BASE, "--workers", "0"), ("inspect", url)):
        code, output = _cli(*args)
        assert code == 2 and "settings.json" in output and "larger than 1 MiB" in output, output
    assert "settings.json" not in fetched, fetched
