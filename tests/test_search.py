"""search: each file is its own nearest, exact copies group as duplicates, faiss and numpy agree,
the faiss index is cached in OUT until the manifest changes, and a new file is encoded as OUT was."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import gemma4enc
from gemma4enc.commands.cli import app
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


@pytest.mark.parametrize("use_faiss", [False, True])
def test_each_file_is_its_own_nearest(folder, use_faiss):
    _, media, out = folder
    want = cosines(out)
    report = search_module.search(out, list(want), k=len(want), use_faiss=use_faiss)
    assert report["backend"] == ("faiss" if use_faiss else "numpy") and report["rows"] == 5 and not report["failed"]
    for result in report["results"]:
        hits = result["hits"]
        assert result["source"] == "out" and hits[0]["path"] == result["path"] and hits[0]["score"] == pytest.approx(1)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert sorted(h["path"] for h in hits) == sorted(want)  # each latest ok file once, no failed or stale row
        for hit in hits:
            assert hit["score"] == pytest.approx(want[result["path"]][hit["path"]], abs=1e-5)
    index, _ = search_module.load_index(out, use_faiss=use_faiss)  # the index alone, before the own-first rule
    vectors = index.matrix if index.matrix is not None else index.faiss.reconstruct_n(0, len(index))
    scores, ids = index.search(vectors, 1)
    for i, (score, top) in enumerate(zip(scores[:, 0], ids[:, 0])):
        assert score == pytest.approx(1, abs=1e-6)
        assert want[index.paths[i]][index.paths[top]] == pytest.approx(1, abs=1e-6)  # itself, or its exact copy
    copy = next(r for r in report["results"] if r["path"].endswith("copy.png"))
    assert copy["hits"][1]["path"] == str(media / "p0.png") and copy["hits"][1]["score"] == pytest.approx(1)


def test_faiss_and_numpy_give_the_same_answers(folder, monkeypatch):
    _, _, out = folder
    monkeypatch.setattr(search_module, "BLOCK", 2)  # the faiss index filled, and pairs scored, 2 rows at a time
    (out / search_module.KEYS).unlink(missing_ok=True)
    files = list(gemma4enc.open(out))
    index, _ = search_module.load_index(out)
    numpy_index, _ = search_module.load_index(out, use_faiss=False)
    assert index.paths == numpy_index.paths
    assert np.allclose(index.faiss.reconstruct_n(0, len(index)), numpy_index.matrix, atol=1e-7)
    groups = [sorted(map(sorted, search_module.duplicates(out, 0.7, use_faiss=f)["groups"])) for f in (True, False)]
    assert groups[0] == groups[1]
    a = search_module.search(out, files, k=3, use_faiss=False)["results"]
    b = search_module.search(out, files, k=3, use_faiss=True)["results"]
    assert [[h["path"] for h in r["hits"]] for r in a] == [[h["path"] for h in r["hits"]] for r in b]
    assert np.allclose([[h["score"] for h in r["hits"]] for r in a], [[h["score"] for h in r["hits"]] for r in b],
                       atol=1e-5)


def test_duplicates_are_the_copies(folder):
    _, media, out = folder
    for use_faiss in (False, True):
        report = search_module.duplicates(out, 0.98, use_faiss=use_faiss)
        assert [sorted(g) for g in report["groups"]] == [sorted([str(media / "p0.png"), str(media / "sub/copy.png")])]
    assert search_module.duplicates(out, -1)["groups"][0].__len__() == 5  # every file, at the loosest bound
    text = cli(out, "--duplicates", "-q").stdout.split()
    assert sorted(text) == sorted([str(media / "p0.png"), str(media / "sub/copy.png")])
    assert json.loads(cli(out, "--duplicates", "--threshold", "1.5", "--json", code=2).stdout)["exit_code"] == 2


def test_the_faiss_index_is_cached_until_the_manifest_changes(folder, tmp_path, monkeypatch):
    root, media, shared = folder
    out = tmp_path / "out"
    shutil.copytree(shared, out)
    (out / search_module.INDEX).unlink(missing_ok=True)
    search_module.load_index(out)
    assert (out / search_module.INDEX).exists() and (out / search_module.KEYS).exists()
    real = search_module._matrix
    monkeypatch.setattr(search_module, "_matrix", lambda *a: pytest.fail("read the shards again"))
    index, _ = search_module.load_index(out)
    assert index.backend == "faiss" and len(index) == 5
    more = tmp_path / "more"
    more.mkdir()
    photo(150, 150, seed=21).save(more / "new.png")
    assert encode([more, "-o", out, "--device", "cpu", "--workers", "0", "-q"]).exit_code == 0  # OUT's settings
    monkeypatch.setattr(search_module, "_matrix", real)
    index, _ = search_module.load_index(out)
    assert len(index) == 6 and str(more / "new.png") in index.paths


def test_a_new_file_is_encoded_with_outs_settings(folder, tmp_path):
    _, media, out = folder
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes((media / "p1.png").read_bytes())
    report = json.loads(cli(out, elsewhere, "-k", "2", "--json", "-q").stdout)
    (result,) = report["results"]
    assert result["source"] == "encoded" and result["path"] == str(elsewhere)
    # the same bytes through OUT's settings (70 tokens, float32 tower, bfloat16 stored): OUT's very vector
    assert result["hits"][0] == {"path": str(media / "p1.png"), "score": pytest.approx(1, abs=1e-6)}
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
    cli(out, media, code=2)  # a folder
    cli(tmp_path, media / "p2.png", code=2)  # not an output folder
    missing = cli(out, tmp_path / "gone.png", media / "p2.png", "--json", code=1)
    report = json.loads(missing.stdout)
    assert report["failed"][0]["file"] == str(tmp_path / "gone.png") and len(report["results"]) == 1
    broken = json.loads(cli(out, media / "broken.png", "--json", "-q", code=1).stdout)
    assert "status" in broken["failed"][0]["error"] and not broken["results"]
