"""search: each file is its own nearest, exact copies group as duplicates (kept and dropped by a
policy, written as JSONL or Parquet), the index is cached in OUT and read on as OUT grows, many
files (folders, --files-from) in one call, and a new file is encoded as OUT was."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import gemma4enc
from gemma4enc.commands.cli import app
from gemma4enc.output import vecstore
from gemma4enc.run import search as search_module

from .helpers import RUN, encode, folder_with_history, photo


@pytest.fixture(scope="module")
def folder(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    media, out = folder_with_history(root, ckpt)
    return root, media, out


def cli(*args, code=0):
    result = RUN.invoke(app, ["search", *map(str, args)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def cosines(out):
    """path → path → cosine, from the reader's pooled vectors."""
    emb = gemma4enc.open(out)
    paths = list(emb)
    unit = {p: emb.pooled(p).float().numpy() / np.linalg.norm(emb.pooled(p).float().numpy()) for p in paths}
    return {a: {b: float(unit[a] @ unit[b]) for b in paths} for a in paths}


F16 = 2e-3  # the cache keeps unit vectors in float16: cosines within this of float32's


def test_each_file_is_its_own_nearest(folder):
    _, media, out = folder
    want = cosines(out)
    report = search_module.search(out, list(want), k=len(want))
    assert report["index"] == "flat" and report["rows"] == 5 and not report["failed"]
    for result in report["results"]:
        hits = result["hits"]
        assert result["source"] == "out" and hits[0]["path"] == result["path"] and hits[0]["score"] == pytest.approx(1)
        assert [h["score"] for h in hits[1:]] == sorted((h["score"] for h in hits[1:]), reverse=True)
        assert sorted(h["path"] for h in hits) == sorted(want)  # each latest ok file once, no failed or stale row
        for hit in hits:
            assert hit["score"] == pytest.approx(want[result["path"]][hit["path"]], abs=F16)
    with search_module.Searcher(out) as searcher:  # the index alone, before the own-first rule
        cache = searcher.cache
        ids = cache.live_ids()
        scores, top = cache.search(np.stack([cache.vector(i) for i in ids]), 1)
        for i, score, t in zip(ids, scores[:, 0], top[:, 0]):
            assert score == pytest.approx(1, abs=F16)
            assert want[cache.path(i)][cache.path(t)] == pytest.approx(1, abs=1e-6)  # itself, or its exact copy
        got = searcher.nearest(media / "p2.png", k=2)  # the API: (path, score) pairs, the index kept open
        assert got[0] == (str(media / "p2.png"), pytest.approx(1)) and len(got) == 2
        assert searcher.nearest_vector(cache.vector(int(ids[0])), k=1)[0][1] == pytest.approx(1, abs=F16)
    copy = next(r for r in report["results"] if r["path"].endswith("copy.png"))
    assert copy["hits"][1]["path"] == str(media / "p0.png") and copy["hits"][1]["score"] == pytest.approx(1, abs=F16)


def test_duplicates_are_the_copies(folder, tmp_path):
    _, media, out = folder
    pair = sorted([str(media / "p0.png"), str(media / "sub/copy.png")])
    for method in ("exact", "partitioned"):
        report = search_module.duplicates(out, 0.98, method=method)
        assert [sorted(g["members"]) for g in report["groups"]] == [pair] and report["method"] == method
        assert report["groups"][0]["keep"] == report["groups"][0]["members"][0]  # first in OUT
        assert report["groups"][0]["drop"] == report["groups"][0]["members"][1:]
    assert search_module.duplicates(out, -1)["groups"][0]["size"] == 5  # every file, at the loosest bound
    text = cli(out, "--duplicates", "-q").stdout.split()
    assert sorted(text) == pair
    dropped = cli(out, "--duplicates", "--drop-list", "-", "--keep", "largest", "-q",
                  "--groups", tmp_path / "g.jsonl").stdout.splitlines()
    (group,) = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert dropped == group["drop"] and len(dropped) == 1 and sorted([group["keep"], *dropped]) == pair
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    cli(out, "--duplicates", "-q", "--groups", tmp_path / "g.parquet")
    assert pq.read_table(tmp_path / "g.parquet").to_pylist()[0]["drop"] == [pair[1]]
    assert json.loads(cli(out, "--duplicates", "--threshold", "1.5", "--json", code=2).stdout)["exit_code"] == 2
    cli(out, "--duplicates", "--keep", "best", code=2)
    cli(out, "--duplicates", "--method", "magic", code=2)
    cli(out, "--duplicates", "--engine", "spark", code=2)


def test_the_index_is_cached_and_read_on_as_out_grows(folder, tmp_path, monkeypatch):
    root, media, shared = folder
    out = tmp_path / "out"
    shutil.copytree(shared, out)
    for name in vecstore.FILES:
        (out / name).unlink(missing_ok=True)
    search_module.Searcher(out).close()
    assert all((out / name).exists() for name in (vecstore.META, vecstore.VECTORS, vecstore.ROWS, vecstore.PATHS))
    monkeypatch.setattr(vecstore, "_build", lambda *a: pytest.fail("read the shards again"))
    monkeypatch.setattr(vecstore, "_append", lambda *a: pytest.fail("nothing was appended"))
    with search_module.Searcher(out) as searcher:
        assert searcher.cache.live == 5
    more = tmp_path / "more"
    more.mkdir()
    photo(150, 150, seed=21).save(more / "new.png")
    photo(160, 170, seed=22).save(more / "changed.png")
    assert encode([more, "-o", out, "--device", "cpu", "--workers", "0", "-q"]).exit_code == 0  # OUT's settings
    monkeypatch.undo()
    monkeypatch.setattr(vecstore, "_build", lambda *a: pytest.fail("read every shard again"))
    with search_module.Searcher(out) as searcher:
        assert searcher.cache.live == searcher.cache.n == 7
    photo(170, 160, seed=23).save(more / "changed.png")  # its old row is superseded by the re-run
    assert encode([more, "-o", out, "--device", "cpu", "--workers", "0", "-q"]).exit_code == 0
    monkeypatch.undo()
    monkeypatch.setattr(vecstore, "_build", lambda *a: pytest.fail("read every shard again"))
    with search_module.Searcher(out) as searcher:  # read on: one id added, one superseded (a tombstone)
        cache = searcher.cache
        assert cache.live == 7 and cache.n == 8 and cache.find(str(more / "new.png")) >= 0
        stale = int(np.flatnonzero(cache.dead)[0])
        assert cache.path(stale) == str(more / "changed.png")
        fresh = cache.find(str(more / "changed.png"))
        assert fresh > stale and not np.array_equal(cache.vector(fresh), cache.vector(stale))
        hits = [p for p, _ in searcher.nearest_vector(cache.vector(stale), k=8)]
        assert len(hits) == 7 and len(set(hits)) == 7  # the dead id is never a hit
    monkeypatch.undo()
    want = {p: v / np.linalg.norm(v) for p, v in ((p, gemma4enc.open(out, "numpy").pooled(p)) for p in
                                                  gemma4enc.open(out, "numpy"))}
    with search_module.Searcher(out, rebuild=True) as searcher:  # the same vectors as a build from scratch
        cache = searcher.cache
        assert cache.n == cache.live == 7
        for path, v in want.items():
            assert np.allclose(cache.vector(cache.find(path)), v, atol=F16)


def test_a_new_file_is_encoded_with_outs_settings(folder, tmp_path):
    _, media, out = folder
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes((media / "p1.png").read_bytes())
    report = json.loads(cli(out, elsewhere, "-k", "2", "--json", "-q").stdout)
    (result,) = report["results"]
    assert result["source"] == "encoded" and result["path"] == str(elsewhere)
    # the same bytes through OUT's settings (70 tokens, float32 tower, bfloat16 stored): OUT's very vector
    assert result["hits"][0] == {"path": str(media / "p1.png"), "score": pytest.approx(1, abs=F16)}
    assert result["hits"][1]["score"] < 0.99


def test_command_line(folder, tmp_path):
    _, media, out = folder
    lines = cli(out, media / "p2.png", "-k", "3").stdout.splitlines()
    assert len(lines) == 3 and lines[0].split() == ["1.0000", str(media / "p2.png")]
    both = cli(out, media / "p2.png", media / "p0.png", "-k", "2").stdout.splitlines()
    assert both[0] == f"{media / 'p2.png'}:" and both[3] == f"{media / 'p0.png'}:" and len(both) == 6
    cli(out, code=2)  # neither files nor --duplicates
    cli(out, media / "p2.png", "--duplicates", code=2)
    cli(out, media / "p2.png", "-k", "0", code=2)
    cli(out, media, "--files-from", tmp_path / "no-such-list", code=2)
    (tmp_path / "empty").mkdir()
    cli(out, tmp_path / "empty", code=2)  # a folder with no media in it
    listing = tmp_path / "list.txt"
    listing.write_text(f"{media / 'p0.png'}\n{media / 'sub'}\n")
    many = json.loads(cli(out, media / "p2.png", "--files-from", listing, "-k", "1", "--json", "-q").stdout)
    assert [r["path"] for r in many["results"]] == [str(media / n) for n in ("p2.png", "p0.png", "sub/copy.png")]
    folder_report = json.loads(cli(out, media / "sub", "-k", "2", "--json", "-q").stdout)  # a folder: its files
    assert [r["path"] for r in folder_report["results"]] == [str(media / "sub/copy.png")]
    cli(tmp_path, media / "p2.png", code=2)  # not an output folder
    missing = cli(out, tmp_path / "gone.png", media / "p2.png", "--json", code=1)
    report = json.loads(missing.stdout)
    assert report["failed"][0]["file"] == str(tmp_path / "gone.png") and len(report["results"]) == 1
    broken = json.loads(cli(out, media / "broken.png", "--json", "-q", code=1).stdout)
    assert "status" in broken["failed"][0]["error"] and not broken["results"]


def test_the_threshold_scripts_video_copy_is_another_codec_at_half_size(tmp_path):
    """benchmarks/thresholds.py's re-encoded copy (docs/search.md's "re-encoded video" row): it
    decodes, holds every frame of the source at half its size, in a codec other than the source's."""
    import importlib.util
    from pathlib import Path

    import av

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "thresholds.py"
    spec = importlib.util.spec_from_file_location("thresholds", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.scene_video(tmp_path / "a.mp4", seed=1, frames=12, size=(96, 64))
    copy = bench.reencode(tmp_path / "a.mp4", tmp_path / "a~re")
    with av.open(str(tmp_path / "a.mp4")) as src, av.open(str(copy)) as dst:
        frames = [list(f.decode(video=0)) for f in (src, dst)]
        codecs = [f.streams.video[0].codec_context.name for f in (src, dst)]
    assert [len(f) for f in frames] == [12, 12]
    assert (frames[0][0].width, frames[0][0].height) == (96, 64)
    assert {(f.width, f.height) for f in frames[1]} == {(48, 32)}
    # another codec unless this PyAV has no encoder but x264 (the copy then differs by quality only)
    assert codecs[0] == "h264" and (codecs[1] != "h264") == (bench.recode_codec()[0] != "libx264")
