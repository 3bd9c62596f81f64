"""A first run in bounded memory: discovery hands over chunks as the engine reaches them; every file
still gets one row, tokens equal one list's, and the counts add up."""

from __future__ import annotations

import json

import torch

from gemma4enc.media import discover as discovery
from gemma4enc.run.stream import Stream

from .helpers import BASE, encode, photo, shard_tokens


def _folder(root, n, start=0):
    for i in range(start, start + n):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        photo(24 + i % 5, 30 + i % 7, seed=i).save(sub / f"p{i:03d}.png")
    (root / "notes.txt").write_text("not media")


def _summary(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_discovery_streams_sorted_chunks_only_where_no_path_can_come_twice(tmp_path):
    _folder(tmp_path / "m", 11)
    chunks = list(discovery.discover_chunks([str(tmp_path / "m")], chunk=4))
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert all([i.path for i in c] == sorted(i.path for i in c) for c in chunks)
    whole, skipped = discovery.discover([str(tmp_path / "m")])
    assert sorted(i.path for c in chunks for i in c) == [i.path for i in whole] and skipped == 1
    # a named file beside its folder, or a folder inside another: one deduplicated list
    named = str(tmp_path / "m" / "d0" / "p000.png")
    for roots in ([str(tmp_path / "m"), named], [str(tmp_path / "m"), str(tmp_path / "m" / "d1")]):
        (one,) = discovery.discover_chunks(roots, chunk=4)
        assert [i.path for i in one] == [i.path for i in whole]


def test_the_stream_pulls_chunks_only_as_the_engine_reaches_them():
    pulled = []

    def chunks():
        for k in range(3):
            pulled.append(k)
            yield [f"c{k}-{j}" for j in range(2)]

    decided = Stream(["a"], ["a"], chunks(), lambda chunk: [x for x in chunk if x.endswith("0")]).primed()
    it = iter(decided)
    assert next(it) == "a" and pulled == [] and len(decided) == 1
    assert next(it) == "c0-0" and pulled == [0]
    assert list(it) == ["c1-0", "c2-0"] and (decided.found, decided.todo) == (7, 4)
    # nothing to do in any chunk: primed() is empty, so no model is loaded
    assert Stream([], [], chunks(), lambda chunk: []).primed() == []


def test_a_streamed_first_run_equals_one_list(ckpt, tmp_path, monkeypatch):
    media = tmp_path / "media"
    _folder(media, 10)
    args = ["--model", ckpt, *BASE, "--workers", "0", "--max-soft-tokens", "70"]
    whole = _summary(encode([media, "-o", tmp_path / "whole", *args]))
    monkeypatch.setattr(discovery, "CHUNK", 3)
    pulls, pull = [], Stream._next
    monkeypatch.setattr(Stream, "_next", lambda self: pulls.append(len(self)) or pull(self))
    streamed = _summary(encode([media, "-o", tmp_path / "out", *args]))
    assert len(pulls) == 4  # the first chunk came before the lock; 3 more, then the end
    for key in ("files", "done_before", "encoded", "failed", "tokens"):
        assert streamed[key] == whole[key], key
    rows, got = shard_tokens(tmp_path / "out")
    _, want = shard_tokens(tmp_path / "whole")
    assert len(rows) == len(got) == 10 and got.keys() == want.keys()
    assert all(torch.equal(got[p], want[p]) for p in want)
    again = _summary(encode([media, "-o", tmp_path / "out", *args]))
    assert (again["files"], again["done_before"], again["encoded"]) == (10, 10, 0)
    _folder(media, 4, start=10)  # new files in a later chunk: only they are encoded
    more = _summary(encode([media, "-o", tmp_path / "out", *args]))
    assert (more["files"], more["done_before"], more["encoded"]) == (14, 10, 4)
    assert len(shard_tokens(tmp_path / "out")[1]) == 14
