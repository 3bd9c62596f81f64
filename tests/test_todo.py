"""outdir.py on its own: what is left to do against a manifest, and the repair of what a kill
leaves in OUT. Manifests are written here by hand, shards by the real ShardWriter; no model runs.
When one of these fails, the stage that broke is the ledger of what is done."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gemma4enc.errors import UsageError
from gemma4enc.media.discover import discover
from gemma4enc.media.kinds import Item
from gemma4enc.options import Options
from gemma4enc.output.files import MANIFEST, append_rows
from gemma4enc.output.ledger import Ledger
from gemma4enc.output.opening import open_out
from gemma4enc.output.shards import ShardWriter
from gemma4enc.output.todo import Unchanged, still_to_do
from gemma4enc.rows import Row, Status

from .helpers import photo


def row_for(path: Path, status: str = "ok", **changes) -> dict:
    """The row a run would have written for the file as it is now."""
    st = path.stat()
    row = {"path": str(path), "kind": "image", "size": st.st_size, "mtime_ns": st.st_mtime_ns, "status": status,
           "error": None if status == "ok" else "it failed", "shard": None, "index": None, "tokens": 0, "frames": 0}
    return row | changes


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]


def names(items) -> list[str]:
    return sorted(os.path.basename(i.path) for i in items)


@pytest.fixture
def media(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    for i, name in enumerate("abcdefghij"):
        photo(20 + i, 30, seed=i).save(root / f"{name}.png")
    return root


def test_new_changed_failed_and_lost_files_are_left_to_do(media, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = {n: media / f"{n}.png" for n in "abcdef"}
    append_rows(out, [
        row_for(p["a"]),  # done, unchanged
        row_for(p["b"], size=p["b"].stat().st_size + 1),  # changed size
        row_for(p["c"], mtime_ns=p["c"].stat().st_mtime_ns - 1),  # changed mtime
        # d has no row: new
        row_for(p["e"], status="decode_error"),  # failed: left alone unless --retry-failed
        row_for(p["f"], status="shard_lost"),  # its shard went missing: always again
    ])
    written = (out / MANIFEST).read_bytes()
    items = [i for i in discover([str(media)])[0] if os.path.basename(i.path)[0] in "abcdef"]
    assert names(still_to_do(items, open_out(out), Options())) == ["b.png", "c.png", "d.png", "f.png"]
    assert names(still_to_do(items, open_out(out), Options(retry_failed=True))) == ["b.png", "c.png", "d.png", "e.png", "f.png"]
    assert (out / MANIFEST).read_bytes() == written  # deciding wrote nothing


def test_with_hash_the_content_decides(media, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    digest = {n: hashlib.sha256((media / f"{n}.png").read_bytes()).hexdigest() for n in "ghij"}
    touched = media / "g.png"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    append_rows(out, [
        row_for(touched, mtime_ns=st.st_mtime_ns, sha256=digest["g"]),  # touched only: same content
        row_for(media / "h.png", sha256="0" * 64),  # same size and mtime, other content
        # encoded before --hash was turned on: its tokens may be of older bytes of the same size
        # and mtime, so no hash of today's bytes is written onto it; it is encoded again
        row_for(media / "i.png"),
        row_for(media / "j.png", mtime_ns=1),  # no hash recorded and another mtime: cannot tell, so again
    ])
    items = [i for i in discover([str(media)])[0] if os.path.basename(i.path)[0] in "ghij"]
    assert names(still_to_do(items, open_out(out), Options())) == ["g.png", "j.png"]  # size + mtime only: h is missed
    assert names(still_to_do(items, open_out(out), Options(hash=True))) == ["h.png", "i.png", "j.png"]
    refreshed = {Path(r["path"]).name: r for r in manifest(out)[4:]}
    assert sorted(refreshed) == ["g.png"]
    assert refreshed["g.png"]["mtime_ns"] == st.st_mtime_ns + 10**9 and refreshed["g.png"]["sha256"] == digest["g"]


def test_a_file_under_a_moved_root_adopts_its_row(media, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    old = tmp_path / "old"
    shutil.copytree(media, old, copy_function=shutil.copy2)  # copy2 keeps the mtimes, as a move does
    append_rows(out, [row_for(old / n, root=str(old), rel=n, shard="shard-000004.safetensors", index=i, tokens=9)
                      for i, n in enumerate(("a.png", "b.png"))])
    shutil.rmtree(old)  # moved: the old path is gone
    (media / "b.png").write_bytes((media / "b.png").read_bytes() + b"\0")  # changed while it moved
    items = [i for i in discover([str(media)])[0] if os.path.basename(i.path) in ("a.png", "b.png")]
    assert names(still_to_do(items, open_out(out), Options())) == ["b.png"]
    adopted, superseded = manifest(out)[2:]  # the old path's row superseded: one row per file
    assert {k: adopted[k] for k in ("path", "root", "rel", "shard", "index", "tokens")} == {
        "path": str(media / "a.png"), "root": str(media), "rel": "a.png", "shard": "shard-000004.safetensors",
        "index": 0, "tokens": 9}
    assert {k: superseded[k] for k in ("path", "status", "moved_to", "shard", "index", "tokens")} == {
        "path": str(old / "a.png"), "status": "moved", "moved_to": str(media / "a.png"), "shard": None,
        "index": None, "tokens": 0}


def test_a_split_beside_another_keeps_its_own_rows(tmp_path):
    """Two dataset splits from one archive: same names, sizes and mtimes, other content. The
    second is not a moved first (the first is still there): only equal content (--hash) adopts."""
    out = tmp_path / "out"
    out.mkdir()
    train, val = tmp_path / "data" / "train", tmp_path / "data" / "val"
    train.mkdir(parents=True)
    val.mkdir()
    for i, name in enumerate(("f0.ppm", "f1.ppm", "f2.ppm")):  # fixed-size frames: every size is the same
        photo(16, 12, seed=i).save(train / name)
        photo(16, 12, seed=10 + i if name != "f2.ppm" else i).save(val / name)  # f2: the same picture in both
        for p in (train / name, val / name):
            os.utime(p, ns=(10**18, 10**18))
    assert (train / "f0.ppm").read_bytes() != (val / "f0.ppm").read_bytes()
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    append_rows(out, [row_for(train / n, root=str(train), rel=n, shard="shard-000000.safetensors", index=i,
                              tokens=9, sha256=digest(train / n))
                      for i, n in enumerate(("f0.ppm", "f1.ppm", "f2.ppm"))])
    items = discover([str(val)])[0]
    assert [i.rel for i in items] == ["f0.ppm", "f1.ppm", "f2.ppm"]
    assert names(still_to_do(items, open_out(out), Options())) == ["f0.ppm", "f1.ppm", "f2.ppm"]
    assert len(manifest(out)) == 3  # nothing adopted
    assert names(still_to_do(items, open_out(out), Options(hash=True))) == ["f0.ppm", "f1.ppm"]
    adopted = manifest(out)[3:]
    assert [(r["path"], r["index"], r["sha256"]) for r in adopted] == [(str(val / "f2.ppm"), 2, digest(val / "f2.ppm"))]


def test_a_root_reached_through_a_symlink_adopts_its_rows(media, tmp_path):
    """The same files under another name (a root given through a link): their rows are theirs."""
    out = tmp_path / "out"
    out.mkdir()
    link = tmp_path / "link"
    link.symlink_to(media)
    append_rows(out, [row_for(media / "a.png", root=str(media), rel="a.png", shard="shard-000000.safetensors",
                              index=0, tokens=9)])
    items = [i for i in discover([str(link)])[0] if os.path.basename(i.path) == "a.png"]
    assert still_to_do(items, open_out(out), Options()) == []
    assert manifest(out)[1]["path"] == str(link / "a.png")


def test_discovery_keeps_only_what_is_left_to_do_and_counts_the_rest(media, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = {n: media / f"{n}.png" for n in "abcdefghij"}
    append_rows(out, [
        row_for(p["a"]), row_for(p["g"]), row_for(p["h"]), row_for(p["i"]),  # done, unchanged
        row_for(p["b"], size=1), row_for(p["c"], mtime_ns=1),  # changed
        row_for(p["e"], status="decode_error"),  # failed, unchanged: done unless --retry-failed
        row_for(p["f"], status="shard_lost"),  # lost: always again
        row_for(p["a"]), {"path": 7},  # a repeated row; a line the ledger cannot use (rows ≠ lines)
    ])  # d and j: no row
    everything = discover([str(media)])[0]
    for options, kept, counted in [
            (Options(), "bcdfj", 5), (Options(retry_failed=True), "bcdefj", 4), (Options(hash=True), "abcdfghij", 1)]:
        unchanged = Unchanged(Ledger.load(out), options)
        items, _ = discover([str(media)], known=unchanged.known)
        assert "".join(n[0] for n in names(items)) == kept and len(unchanged) == counted
        assert items == sorted(items, key=lambda i: i.path)  # the order files are processed in
        whole = still_to_do(everything, open_out(out), options)
        assert names(still_to_do(items, open_out(out), options)) == names(whole)  # the same decision, from fewer Items
        assert names(unchanged.again(items)) == names(items)  # nothing read since: the marks stand


def test_a_file_counted_done_is_decided_again_when_its_row_changes_before_the_lock(tmp_path):
    out = tmp_path / "out"
    media = tmp_path / "media"
    media.mkdir()
    for i in range(3):
        photo(20, 20 + i, seed=i).save(media / f"{i}.png")
    writer = ShardWriter(open_out(out), "float32", {"model": "test"})
    for i, path in enumerate(sorted(media.iterdir())):
        writer.add(Row.from_json(row_for(path, root=str(media), rel=path.name, tokens=3, frames=1)), [torch.full((3, 4), float(i))])
    writer.close()
    extra = tmp_path / "one.png"  # a named file: its row records no root
    photo(21, 21).save(extra)
    append_rows(out, [row_for(extra)])
    ledger = Ledger.load(out)
    unchanged = Unchanged(ledger, Options())
    items, _ = discover([str(media), str(extra)], known=unchanged.known)
    assert items == [] and len(unchanged) == 4
    (out / "shard-000000.safetensors").unlink()  # before the lock: the repair marks its files lost
    open_out(out).repair(ledger)
    back = unchanged.again(items)
    assert [(os.path.basename(i.path), i.root, i.rel) for i in back] == [
        (f"{i}.png", str(media), f"{i}.png") for i in range(3)]  # as discovery would have made them
    assert names(still_to_do(back, open_out(out), Options(), ledger)) == ["0.png", "1.png", "2.png"]
    assert len(unchanged) == 1  # one.png still counted, no longer the other three

    unchanged = Unchanged(ledger, Options())  # now: another run compacts the manifest (a new file)
    items, _ = discover([str(media), str(extra)], known=unchanged.known)
    assert [os.path.basename(i.path) for i in items] == ["0.png", "1.png", "2.png"] and len(unchanged) == 1
    open_out(out).compact(Ledger(out))
    ledger.refresh()
    back = unchanged.again(items)
    assert [(os.path.basename(i.path), i.root, i.rel) for i in back] == [
        ("0.png", str(media), "0.png"), ("1.png", str(media), "1.png"), ("2.png", str(media), "2.png"),
        ("one.png", None, None)]
    assert len(unchanged) == 0 and names(still_to_do(back, open_out(out), Options(), ledger)) == ["0.png", "1.png", "2.png"]


def written(out: Path, n: int) -> list[str]:
    """n files' tokens in one real shard (shard-000000), their rows in the manifest."""
    writer = ShardWriter(open_out(out), "float32", {"model": "test"})
    paths = [f"/media/{i}.jpg" for i in range(n)]
    for i, path in enumerate(paths):
        writer.add(Row(path, "image", 100 + i, 7, Status.OK, tokens=3, frames=1), [torch.full((3, 4), float(i))])
    writer.close()
    return paths


def test_repair_undoes_what_a_kill_leaves_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    paths = written(out, 2)
    whole = (out / MANIFEST).read_bytes()
    with open(out / MANIFEST, "ab") as f:
        f.write(b'{"path": "/media/9.jpg", "si')  # killed mid-line
    ours = [".gemma4enc-shard-000001.safetensors.4242.tmp", ".manifest.jsonl.77.tmp", ".write-test-5.tmp"]
    theirs = [".draft.tmp", "notes.txt", "shard-notes.safetensors", "shard-1.safetensors"]  # not our names
    for name in ours + theirs:
        (out / name).write_bytes(b"half")
    shutil.copy(out / "shard-000000.safetensors", out / "shard-000001.safetensors")  # written, its rows never
    notes = open_out(out).repair()
    assert (out / MANIFEST).read_bytes() == whole  # the torn line is gone, the next append starts a line
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "shard-000000.safetensors", *theirs])
    assert notes == ["dropped a torn last line of the manifest (its file will be encoded again)",
                     "removed 3 temp file(s) of an interrupted run", "removed 1 shard(s) of an interrupted run"]
    assert [r["path"] for r in manifest(out)] == paths
    assert open_out(out).repair() == []  # nothing left to undo


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_repair_marks_the_files_of_a_lost_shard_to_be_encoded_again(tmp_path, damage):
    out = tmp_path / "out"
    paths = written(out, 3)
    items = [Item(p, "image", 100 + i, 7) for i, p in enumerate(paths)]  # as their rows record them
    assert still_to_do(items, open_out(out), Options()) == []
    shard = out / "shard-000000.safetensors"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    notes = open_out(out).repair()
    lost_note = "1 shard(s) missing or unreadable (shard-000000.safetensors): their 3 file(s) are encoded again"
    removed = [] if damage == "missing" else ["removed 1 shard(s) of an interrupted run"]
    assert notes == [lost_note, *removed]
    lost = manifest(out)[3:]
    assert [(r["path"], r["status"], r["shard"], r["index"], r["tokens"]) for r in lost] == [
        (p, "shard_lost", None, None, 0) for p in paths]
    assert not shard.exists()  # no live row names it now
    assert [i.path for i in still_to_do(items, open_out(out), Options())] == paths


def test_settings_are_recorded_once_and_only_output_shaping_ones_must_match(tmp_path):
    from gemma4enc.options import Sampling

    out = tmp_path / "out"
    first = Options(dtype="float32", sampling=Sampling(frames=4))
    assert open_out(out).prepare(first) == []
    open_out(out).record_settings(first)
    recorded = json.loads((out / "settings.json").read_text())
    assert recorded["sampling"] == {"frames": 4, "fps": None, "max_frames": 32} and recorded["dtype"] == "float32"
    assert "workers" not in recorded and "batching" not in recorded
    open_out(out).prepare(Options(dtype="float32", sampling=Sampling(frames=4), workers=3, batching="pack"))  # speed only
    with pytest.raises(UsageError, match=r"other settings \(sampling: .*'frames': 4.* → .*'frames': 6"):
        open_out(out).prepare(Options(dtype="float32", sampling=Sampling(frames=6)))
    with pytest.raises(UsageError, match=r"other settings \(dtype: 'float32' → 'bfloat16'\)"):
        open_out(out).prepare(Options(dtype="bfloat16", sampling=Sampling(frames=4)))
    del recorded["seek"]  # a folder from a version that did not record seek yet
    (out / "settings.json").write_text(json.dumps(recorded))
    open_out(out).prepare(Options(dtype="float32", sampling=Sampling(frames=4), seek="keyframe"))
    open_out(out).record_settings(Options(dtype="bfloat16"))  # recorded once: a later run only checks
    assert json.loads((out / "settings.json").read_text()) == recorded


def test_a_tar_member_still_in_its_tar_has_not_moved_away(tmp_path):
    """Adoption's 'is the old one gone?' asks the tar (or the store) of a member or a URL: a stat of
    TAR/MEMBER, which no file system holds, would call every such row gone and adopt it."""
    import tarfile

    from gemma4enc.output.todo import _moved_away

    photo(8, 8).save(tmp_path / "a.jpg")
    for name in ("one.tar", "two.tar"):
        with tarfile.open(tmp_path / name, "w") as tar:
            tar.add(tmp_path / "a.jpg", arcname="a.jpg")
    assert not _moved_away(str(tmp_path / "one.tar" / "a.jpg"), str(tmp_path / "two.tar" / "a.jpg"))
    (tmp_path / "one.tar").unlink()
    assert _moved_away(str(tmp_path / "one.tar" / "a.jpg"), str(tmp_path / "two.tar" / "a.jpg"))
    fsspec = pytest.importorskip("fsspec")
    with fsspec.open("memory://split-a/a.jpg", "wb") as f:  # a URL input still in its store
        f.write((tmp_path / "a.jpg").read_bytes())
    assert not _moved_away("memory://split-a/a.jpg", "memory://split-b/a.jpg")
    fsspec.filesystem("memory").rm("memory://split-a/a.jpg")
    assert _moved_away("memory://split-a/a.jpg", "memory://split-b/a.jpg")
