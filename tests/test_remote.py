"""Inputs by URL and WebDataset tars, against an S3 server on loopback (moto's server mode) read
through s3fs as users run it: tokens equal a local folder's, a re-run encodes nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from gemma4enc.media import remote, webdataset

from .helpers import BASE, RUN, close, encode, encode_argv, loopback_s3, shard_tokens, verify

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "media-bucket"


@pytest.fixture(scope="module")
def s3():
    """A loopback S3 (moto) for this module, found by s3fs through the usual AWS_* variables."""
    with loopback_s3(BUCKET) as (fs, _):
        yield fs


def _tokens_by_rel(out: Path) -> tuple[dict, dict]:
    rows, tokens = shard_tokens(out)
    latest = {r["path"]: r for r in rows}
    return ({r["rel"]: r for r in latest.values()},
            {latest[p]["rel"]: t for p, t in tokens.items()})


def _summary(result) -> dict:
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_s3_folder_equals_the_same_folder_encoded_locally(s3, good, ckpt, tmp_path):
    s3.put(str(good), f"{BUCKET}/good", recursive=True)
    local, remote_out = tmp_path / "local", tmp_path / "remote"
    args = ["--model", ckpt, *BASE, "--workers", "0"]
    assert encode([good, "-o", local, *args]).exit_code == 0
    first = encode([f"s3://{BUCKET}/good", "-o", remote_out, *args])
    assert first.exit_code == 0, first.output
    local_rows, local_tokens = _tokens_by_rel(local)
    rows, tokens = _tokens_by_rel(remote_out)
    assert set(rows) == set(local_rows) and len(rows) == 6
    for rel, row in rows.items():
        assert row["path"] == f"s3://{BUCKET}/good/{rel}" and row["root"] == f"s3://{BUCKET}/good"
        assert row["status"] == "ok" and row["size"] == local_rows[rel]["size"]
        assert row["kind"] == local_rows[rel]["kind"]
        assert torch.equal(tokens[rel], local_tokens[rel]), rel
    assert verify(remote_out)["ok"]
    again = _summary(encode([f"s3://{BUCKET}/good", "-o", remote_out, *args]))
    assert (again["encoded"], again["done_before"]) == (0, 6)

    # an object written again with other content is encoded again, and only it
    s3.pipe(f"{BUCKET}/good/photo0.jpg", (good / "photo1.jpg").read_bytes())
    changed = _summary(encode([f"s3://{BUCKET}/good", "-o", remote_out, *args]))
    assert (changed["encoded"], changed["done_before"]) == (1, 5)
    rows, tokens = _tokens_by_rel(remote_out)
    assert torch.equal(tokens["photo0.jpg"], local_tokens["photo1.jpg"])


def test_files_from_urls_in_worker_processes(s3, good, ckpt, tmp_path):
    """--files-from with s3:// lines, decoded by the usual worker processes (a process of its own,
    so its workers start with the server's endpoint in their environment)."""
    s3.put(str(good / "small.png"), f"{BUCKET}/listed/small.png")
    s3.put(str(good / "clip.mp4"), f"{BUCKET}/listed/clip.mp4")
    listing = tmp_path / "list.txt"
    listing.write_text(f"s3://{BUCKET}/listed/small.png\ns3://{BUCKET}/listed/clip.mp4\n")
    local, out = tmp_path / "local", tmp_path / "out"
    assert encode([good / "small.png", good / "clip.mp4", "-o", local, "--model", ckpt, *BASE,
                   "--workers", "0"]).exit_code == 0
    run = subprocess.run(encode_argv("--files-from", listing, "-o", out, "--model", ckpt, *BASE, "--workers", "2"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    _, want = shard_tokens(local)
    _, got = shard_tokens(out)
    assert sorted(got) == [f"s3://{BUCKET}/listed/clip.mp4", f"s3://{BUCKET}/listed/small.png"]
    for path, t in got.items():
        assert torch.equal(t, want[str(good / Path(path).name)]), path


def _shard(path: Path, samples: list[tuple[str, Path]]) -> None:
    """A WebDataset shard as img2dataset writes one: KEY.jpg beside KEY.json and KEY.txt."""
    with tarfile.open(path, "w") as t:
        for key, media in samples:
            t.add(media, arcname=f"{key}{media.suffix}")
            for ext, data in ((".json", json.dumps({"key": key, "src": media.name})), (".txt", f"caption {key}")):
                info = tarfile.TarInfo(f"{key}{ext}")
                info.size = len(data.encode())
                t.addfile(info, io.BytesIO(data.encode()))


def test_webdataset_tars_local_and_by_url(s3, good, ckpt, tmp_path):
    files = sorted(p for p in good.iterdir())
    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(shards / "shard-00000.tar", [(f"{i:06d}", p) for i, p in enumerate(files[:3])])
    _shard(shards / "shard-00001.tar", [(f"{i:06d}", p) for i, p in enumerate(files[3:], 3)])
    s3.put(str(shards / "shard-00000.tar"), f"{BUCKET}/wds/shard-00000.tar")
    s3.put(str(shards / "shard-00001.tar"), f"{BUCKET}/wds/shard-00001.tar")
    folder, local, by_url = tmp_path / "folder", tmp_path / "local", tmp_path / "url"
    args = ["--model", ckpt, *BASE, "--workers", "0"]
    assert encode([good, "-o", folder, *args]).exit_code == 0
    _, want = shard_tokens(folder)
    pattern = str(shards / "shard-{00000..00001}.tar")
    from gemma4enc.commands.cli import app

    plan = json.loads(RUN.invoke(app, ["plan", pattern, "--json"]).stdout)  # headers read through the tar
    want_plan = json.loads(RUN.invoke(app, ["plan", str(good), "--json"]).stdout)
    assert plan["unreadable"] == 0 and plan["tower_items"] > 6
    assert {k: plan[k] for k in ("files", "tower_items", "tokens")} == {k: want_plan[k] for k in ("files", "tower_items", "tokens")}
    for root, out in ((pattern, local), (f"s3://{BUCKET}/wds/shard-{{00000..00001}}.tar", by_url)):
        result = encode([root, "-o", out, *args])
        assert result.exit_code == 0, result.output
        rows, got = shard_tokens(out)
        assert len(rows) == len(got) == 6  # the sidecars are no items
        for row in rows:
            tar, member = row["path"].rsplit("/", 1)
            assert tar.endswith(".tar") and (row["root"], row["rel"]) == (tar, member)
            key = member.split(".")[0]
            src = json.loads(json.dumps(row["sidecar"]))["json"]["src"]
            assert row["sidecar"] == {"json": {"key": key, "src": src}, "txt": f"caption {key}"}
            assert torch.equal(got[row["path"]], want[str(good / src)]), row["path"]
        assert verify(out)["ok"]
        again = _summary(encode([root, "-o", out, *args]))
        assert (again["encoded"], again["done_before"]) == (0, 6)
    assert {r["path"] for r in shard_tokens(by_url)[0]} == {
        r["path"].replace(str(shards), f"s3://{BUCKET}/wds") for r in shard_tokens(local)[0]}


def test_a_url_without_its_filesystem_package_is_one_line_and_exit_2(ckpt, tmp_path):
    """s3fs not importable (as without the [s3] extra): the line names the extra to install."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "s3fs.py").write_text("raise ImportError('No module named s3fs', name='s3fs')\n")
    env = os.environ | {"PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(encode_argv(f"s3://{BUCKET}/good", "-o", tmp_path / "out", "--model", ckpt, *BASE),
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "s3:// needs s3fs: pip install 'gemma4enc[s3]'" in lines[0], run.stderr


def test_local_runs_do_not_import_fsspec(good, tmp_path):
    code = ("import sys; from gemma4enc.media.discover import discover; items, _ = discover([sys.argv[1]]);"
            "assert items; print('fsspec' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stderr


def test_brace_patterns_and_etag_stamps():
    assert webdataset.expand("s-{00008..00011}.tar") == ["s-00008.tar", "s-00009.tar", "s-00010.tar", "s-00011.tar"]
    assert webdataset.expand("{a,b}/x-{1..2}.tar") == ["a/x-1.tar", "a/x-2.tar", "b/x-1.tar", "b/x-2.tar"]
    assert webdataset.expand("plain.tar") == ["plain.tar"]
    tag = remote.stamp({"ETag": '"abc"'})
    assert tag == remote.stamp({"ETag": "abc"}) != remote.stamp({"ETag": '"abd"'}) and tag > 0
    assert remote.stamp({"mtime": 1.5}) == 1_500_000_000
    assert remote.is_url("s3://b/k") and remote.is_url("file:///tmp") and not remote.is_url("/tmp/s3://x")


def test_file_urls_are_walked_like_the_folder(good):
    """file:// goes through fsspec as any URL: the same files, kinds, sizes and mtimes as the walk."""
    from gemma4enc.media.discover import discover

    local, _ = discover([str(good)])
    by_url, _ = discover([f"file://{good}"])
    assert [i.path for i in by_url] == [f"file://{i.path}" for i in local]
    assert [(i.kind, i.size, i.rel) for i in by_url] == [(i.kind, i.size, i.rel) for i in local]
    # fsspec's local info holds mtime as float seconds: within a microsecond of the ns stat gives
    assert all(abs(u.mtime_ns - i.mtime_ns) < 1000 for u, i in zip(by_url, local))


@pytest.mark.slow
def test_ray_actors_read_urls_and_tars_and_write_an_s3_out(s3, good, ckpt, tmp_path, monkeypatch):
    """--engine ray from an s3:// folder and an s3:// tar to an s3:// OUT, no shared folder: the
    actors read their inputs and upload their shards through s3fs, the driver writes the parts, in
    rounds of ROUND_FILES (4 here: two rounds); tokens equal the local engine's, a re-run encodes
    nothing."""
    pytest.importorskip("ray")
    import gemma4enc
    from gemma4enc.commands.cli import app
    from gemma4enc.run.ray import driver as engine

    monkeypatch.setattr(engine, "ROUND_FILES", 4)

    s3.put(str(good), f"{BUCKET}/forray", recursive=True)
    _shard(tmp_path / "s.tar", [(f"{i:06d}", p) for i, p in enumerate(sorted(good.iterdir())[:2])])
    s3.put(str(tmp_path / "s.tar"), f"{BUCKET}/forray-tar/s.tar")
    roots = [f"s3://{BUCKET}/forray", f"s3://{BUCKET}/forray-tar/s.tar"]
    local, out = tmp_path / "local", f"s3://{BUCKET}/forray-out"
    args = ["--model", ckpt, *BASE, "--workers", "0"]
    assert encode([*roots, "-o", local, *args]).exit_code == 0
    ray = ["--engine", "ray", "--ray-actors", "2", "--task-files", "3"]
    import re
    import tempfile

    def task_folders() -> set[str]:  # the actors' per-task folders (their pid in the name)
        return {n for n in os.listdir(tempfile.gettempdir()) if re.fullmatch(r"gemma4enc-task-\d+-.+", n)}

    before = task_folders()
    result = encode([*roots, "-o", out, *args, *ray])
    summary = _summary(result)
    assert summary["engine"] == "ray" and summary["encoded"] == 8, result.output
    # each task's folder went with it; a folder whose process still lives is another run's on this
    # machine (a second test suite, a user's encode), not a leak of this run's, whose actors are gone
    left = {n for n in task_folders() - before if not _alive(int(n.split("-")[2]))}
    assert left == set(), left
    _, want = shard_tokens(local)
    emb = gemma4enc.open(out)
    got = {p: emb[p] for p, _ in emb.ok_rows()}
    assert set(got) == set(want) and len(got) == 8
    assert all(close(got[p], want[p], 1e-5) for p in want)
    assert sum("sidecar" in emb.row(p) for p in got) == 2
    s3.invalidate_cache()
    names = [n.rsplit("/", 1)[-1] for n in s3.ls(f"{BUCKET}/forray-out")]
    assert sum(n.startswith("shard-") for n in names) == 4  # rounds of 4 files, tasks of 3: 3+1, 3+1
    parts = s3.ls(f"{BUCKET}/forray-out/manifest.parts")
    assert len(parts) == 4 and all(p.endswith(".jsonl") for p in parts)  # one part per task
    checked = RUN.invoke(app, ["verify", out])
    assert checked.exit_code == 0, checked.output
    again = _summary(encode([*roots, "-o", out, *args, *ray]))
    assert (again["encoded"], again["done_before"]) == (0, 8)


def test_a_missing_url_root_is_a_usage_error(s3, ckpt, tmp_path):
    result = encode([f"s3://{BUCKET}/no-such-folder", "-o", tmp_path / "out", "--model", ckpt, *BASE])
    assert result.exit_code == 2 and "no such file or folder" in result.output, result.output


def test_inspect_and_prune_ask_the_store_and_hash_reads_objects(s3, good, ckpt, tmp_path):
    """Deleted inputs by URL and inside a tar are counted by inspect and dropped by compact --prune;
    --hash keeps the tokens of an object only rewritten (same content, new LastModified)."""
    from gemma4enc.commands.cli import app

    s3.put(str(good / "small.png"), f"{BUCKET}/prune/a/small.png")
    s3.put(str(good / "photo0.jpg"), f"{BUCKET}/prune/a/photo0.jpg")
    _shard(tmp_path / "t.tar", [("000000", good / "photo1.jpg")])
    out = tmp_path / "out"
    roots = [f"s3://{BUCKET}/prune/a", str(tmp_path / "t.tar")]
    args = ["--model", ckpt, *BASE, "--workers", "0", "--hash"]
    first = _summary(encode([*roots, "-o", out, *args]))
    assert first["encoded"] == 3
    assert all(r["sha256"] for r in shard_tokens(out)[0])
    inspect = lambda: json.loads(RUN.invoke(app, ["inspect", str(out), "--json"]).stdout)  # noqa: E731
    assert inspect()["deleted_inputs"] == 0
    import time

    time.sleep(1.1)  # LastModified has one-second resolution
    s3.pipe(f"{BUCKET}/prune/a/small.png", (good / "small.png").read_bytes())  # rewritten, same bytes
    touched = _summary(encode([*roots, "-o", out, *args]))
    assert (touched["encoded"], touched["done_before"]) == (0, 3)
    small = [r for r in shard_tokens(out)[0] if r["path"].endswith("small.png")]
    assert len(small) == 2 and small[1]["mtime_ns"] > small[0]["mtime_ns"]  # a refreshed row, same tokens
    assert (small[1]["shard"], small[1]["index"]) == (small[0]["shard"], small[0]["index"])
    s3.rm(f"{BUCKET}/prune/a/photo0.jpg")
    (tmp_path / "t.tar").unlink()
    assert inspect()["deleted_inputs"] == 2
    result = RUN.invoke(app, ["compact", str(out), "--prune", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["path"] for r in shard_tokens(out)[0]] == [f"s3://{BUCKET}/prune/a/small.png"]
    assert verify(out)["ok"]


def test_a_tar_with_a_corrupt_member_and_other_members(good, ckpt, tmp_path):
    """A corrupt member costs its own row; members that are not media are skipped and counted; a
    file that is not a tar is one row saying so."""
    tar = tmp_path / "mixed.tar"
    with tarfile.open(tar, "w") as t:
        t.add(good / "small.png", arcname="a/000000.png")
        for name, data in (("a/000001.jpg", b"\xff\xd8\xff\xe0" + b"\x00" * 64), ("a/000000.cls", b"3")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    fake = tmp_path / "fake.tar"
    fake.write_bytes(b"not a tar at all" * 64)
    out = tmp_path / "out"
    result = encode([tar, fake, "-o", out, "--model", ckpt, *BASE, "--workers", "0"])
    assert result.exit_code == 1, result.output
    summary = _summary(result)
    assert summary["skipped_not_media"] == 1 and summary["by_status"] == {"ok": 1, "decode_error": 1, "unreadable": 1}
    rows = {r["path"]: r for r in shard_tokens(out)[0]}
    assert rows[f"{tar}/a/000000.png"]["status"] == "ok" and "sidecar" not in rows[f"{tar}/a/000000.png"]
    assert rows[f"{tar}/a/000001.jpg"]["status"] == "decode_error"
    assert rows[str(fake)]["status"] == "unreadable" and "tar" in rows[str(fake)]["error"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
