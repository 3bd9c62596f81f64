"""Duplicates that can never delete the wrong file (issue 45): a drop list, and the quarantine move,
name only files that exist, are unchanged since their encode, and have a live, unchanged
duplicate that is kept. Each case follows docs/search.md's recipe for real (`xargs -0 rm --`)
and then checks what is left on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gemma4enc.commands.cli import app

from .helpers import BASE, RUN, encode, photo, verify

POLICIES = ["first", "largest", "smallest", "newest", "oldest", "central", "random"]


def contents(folder: Path) -> list[str]:
    """The distinct photos a folder holds, by content."""
    return sorted({hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()})


@pytest.fixture
def library(tmp_path):
    """Three distinct photos and one exact copy of the first."""
    media = tmp_path / "photos"
    media.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80), (48, 120)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    shutil.copy2(media / "p0.png", media / "copy.png")
    return media


def drop_and_rm(out: Path, *flags: str) -> list[str]:
    """The documented recipe: `search OUT --duplicates -q --drop-list - -0 | xargs -0 rm --`."""
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--drop-list", "-", "-0", *flags])
    assert r.exit_code == 0, r.output
    listed = r.stdout_bytes
    if listed:
        subprocess.run(["xargs", "-0", "rm", "--"], input=listed, check=True)
    return [p.decode() for p in listed.split(b"\0") if p]


@pytest.mark.parametrize("keep", POLICIES)
def test_a_moved_folder_encoded_again_loses_no_photo(library, ckpt, tmp_path, keep):
    """The trial that lost three photos: encode, move the folder, encode again (adopted), drop."""
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    moved = tmp_path / "renamed"
    library.rename(moved)
    assert encode([moved, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    want = contents(moved)
    dropped = drop_and_rm(out, "--keep", keep)
    assert len(dropped) == 1 and Path(dropped[0]).parent == moved, dropped  # one of the two copies
    assert contents(moved) == want and len(list(moved.iterdir())) == 3


def test_an_alias_of_the_folder_is_never_dropped_for_itself(library, ckpt, tmp_path):
    """The same folder encoded through a symlink too: one file, two rows; the drop list never
    names a file whose only copy is the one kept."""
    out = tmp_path / "out"
    alias = tmp_path / "alias"
    alias.symlink_to(library)
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    assert encode([alias, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    want = contents(library)
    for keep in POLICIES:
        drop_and_rm(out, "--keep", keep)
        assert contents(library) == want, keep
    assert len(list(library.iterdir())) == 3  # only one of p0/copy went


def test_a_changed_or_deleted_file_is_never_dropped(library, ckpt, tmp_path):
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    photo(90, 60, seed=7).save(library / "copy.png")  # overwritten by another, unique photo
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "--json", "--drop-list", "-", "-0"])
    assert r.exit_code == 0, r.output
    assert b"copy.png" not in r.stdout_bytes.split(b"{", 1)[0]  # the list before the JSON: nothing
    assert drop_and_rm(out) == []
    (library / "copy.png").unlink()
    shutil.copy2(library / "p1.png", library / "p1-copy.png")  # never encoded: not in OUT
    (library / "p0.png").unlink()  # deleted: its row is gone from every group
    assert drop_and_rm(out) == []
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "--json"])
    stale = {Path(s["path"]).name: s["state"] for s in json.loads(r.stdout)["stale"]}
    assert stale == {"p0.png": "gone", "copy.png": "gone"} or stale.get("p0.png") == "gone", stale


def test_a_name_with_a_newline_is_listed_whole_or_refused(library, ckpt, tmp_path):
    """A copy named 'z⏎b.png': read one path a line, the list would name photos/z (a user's file)
    and b.png. Without -0 the list is refused; with -0 exactly the copy goes."""
    odd = library / "z\nb.png"
    shutil.copy2(library / "p1.png", odd)
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    decoy = library / "z"
    decoy.write_bytes(b"a user's notes")
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--drop-list", "-"])
    assert r.exit_code == 2 and "use -0" in r.output, r.output
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q"])  # the groups' listing: the same rule
    assert r.exit_code == 2 and "use -0" in r.output, r.output
    dropped = drop_and_rm(out, "--keep", "first")
    assert sorted(Path(p).name for p in dropped) == ["p0.png", "z\nb.png"], dropped
    assert decoy.read_bytes() == b"a user's notes"
    assert sorted(p.name for p in library.iterdir()) == ["copy.png", "p1.png", "p2.png", "z"]


def test_move_dropped_rechecks_and_undo_puts_back(library, ckpt, tmp_path):
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    before = {p.name: p.read_bytes() for p in library.iterdir()}
    quarantine = tmp_path / "quarantine"
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "--json", "--move-dropped", str(quarantine)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["moves"]["moved"] == 1
    moved = [p for p in quarantine.rglob("*.png")]
    assert len(moved) == 1 and moved[0].read_bytes() == before["p0.png"]
    assert str(moved[0]).endswith(str(library / moved[0].name))  # its absolute path kept below
    assert verify(out)["ok"]
    back = RUN.invoke(app, ["search", str(out), "--undo-moves", str(quarantine), "--json"])
    assert back.exit_code == 0 and json.loads(back.stdout)["put_back"] == 1, back.output
    assert {p.name: p.read_bytes() for p in library.iterdir()} == before


def test_move_skips_a_file_changed_after_grouping(library, ckpt, tmp_path, monkeypatch):
    """The re-check happens just before each move: a file edited between the groups and its move
    stays where it is."""
    from gemma4enc.run import drop

    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    real_move = drop.move

    def edit_then_move(drops, dest, log):
        for d in drops:
            Path(d.path).write_bytes(Path(d.path).read_bytes() + b"edited")
        return real_move(drops, dest, log)

    monkeypatch.setattr(drop, "move", edit_then_move)
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "--json", "--move-dropped", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["moves"] == {"moved": 0, "not_moved": 1, "undo": str(tmp_path / "q" / drop.UNDO)}
    assert len(list(library.iterdir())) == 4
    assert not list((tmp_path / "q").rglob("*.png"))


def test_encode_and_verify_hold_after_a_move(library, ckpt, tmp_path):
    """cron's `encode && verify` after a remount: the adopted rows supersede the old paths' (one row
    per file: verify clean, export once, inspect counts no failure), and a move back adopts again."""
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    moved = tmp_path / "renamed"
    library.rename(moved)
    again = encode([moved, "-o", out, "--model", ckpt, *BASE])
    assert again.exit_code == 0 and json.loads(again.stdout)["encoded"] == 0, again.output
    report = verify(out)
    assert report["ok"] and not report["warnings"], report
    import gemma4enc

    emb = gemma4enc.open(out)
    assert sorted(Path(p).parent for p, _ in emb.ok_rows()) == [moved] * 4
    inspected = json.loads(RUN.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert inspected["by_status"] == {"ok": 4, "moved": 4} and not inspected["failures"], inspected
    exported = RUN.invoke(app, ["export", str(out), str(tmp_path / "clip"), "--to", "parquet", "--json"])
    assert exported.exit_code == 0 and json.loads(exported.stdout)["rows"] == 4, exported.output
    pruned = RUN.invoke(app, ["compact", str(out), "--prune"])
    assert pruned.exit_code == 0, pruned.output
    moved.rename(library)  # and back
    back = encode([library, "-o", out, "--model", ckpt, *BASE])
    assert back.exit_code == 0 and json.loads(back.stdout)["encoded"] == 0, back.output
    assert verify(out)["ok"]
    assert sorted(Path(p).parent for p, _ in gemma4enc.open(out).ok_rows()) == [library] * 4


def test_groups_files_refuse_what_they_cannot_write(library, ckpt, tmp_path):
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    for target, why in ((tmp_path / "nodir" / "g.jsonl", "No such file"), (tmp_path / "g.csv", ".jsonl or a .parquet"),
                        (Path("/dev/full"), "--groups /dev/full")):
        r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--groups", str(target)])
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--drop-list", str(tmp_path / "nodir" / "d.txt")])
    assert r.exit_code == 2 and "no folder" in r.output, r.output
    import pyarrow.parquet as pq

    assert RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--groups", str(tmp_path / "g.parquet")]).exit_code == 0
    groups = pq.read_table(tmp_path / "g.parquet").to_pylist()
    assert len(groups) == 1 and sorted(groups[0]["members"]) == sorted(str(library / n) for n in ("copy.png", "p0.png"))


def test_the_small_ones_of_the_trial(library, ckpt, tmp_path):
    """A pair scores alike both ways; a tar given as the query lists each member under its name;
    export --to vllm says when its pixels are not vLLM's and tells a changed file from one without
    a content hash."""
    import io
    import tarfile

    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    a, b = str(library / "p1.png"), str(library / "p2.png")
    both = json.loads(RUN.invoke(app, ["search", str(out), a, b, "-k", "4", "--json"]).stdout)["results"]
    score = {(r["path"], h["path"]): h["score"] for r in both for h in r["hits"]}
    assert score[(a, b)] == score[(b, a)]
    tar = tmp_path / "q.tar"
    with tarfile.open(tar, "w") as t:
        for n in ("p1.png", "p2.png"):
            t.add(library / n, arcname=f"00000{n[1]}.png")
    listed = RUN.invoke(app, ["search", str(out), str(tar), "-k", "1"])
    assert listed.exit_code == 0 and listed.stdout.count(".tar/00000") == 2, listed.output  # a header each
    (library / "p0.png").write_bytes((library / "p0.png").read_bytes() + b"\0")  # changed since its encode
    r = RUN.invoke(app, ["export", str(out), str(tmp_path / "v"), "--to", "vllm"])
    assert r.exit_code == 0, r.output
    assert "1 changed or gone since their encode" in r.output and "without a content hash" not in r.output
    assert "--resize exact: its pixels are not vLLM's own" in r.output


def test_a_file_is_named_absolute_and_only_near_misses_are_suggested(library, ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert encode([library, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    monkeypatch.chdir(library)
    got = json.loads(RUN.invoke(app, ["search", str(out), "p1.png", str(library), "-k", "1", "--json"]).stdout)
    files = [r["file"] for r in got["results"]]
    assert str(library / "p1.png") in files and all(f.startswith("/") for f in files)  # as a folder's members
    far = RUN.invoke(app, ["encode", str(library), "--bogus"])
    assert far.exit_code == 2 and "--out" not in far.output, far.output
    near = RUN.invoke(app, ["encode", str(library), "--ouput", "x"])
    assert near.exit_code == 2 and "--out" in near.output, near.output
