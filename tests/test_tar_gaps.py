"""WebDataset shards as img2dataset leaves them after a bad night: a tar missing from the brace
range, a tar whose download stopped mid-member, a tar that stops before its end-of-archive marker.
The run encodes every whole member (the same tokens as the files themselves), records each gap
and each cut in a row of its own, adds no row on a re-run over the same state, and encodes what
was missing once the tars are whole. Locally and by URL (a loopback S3)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from .helpers import BASE, encode, loopback_s3, shard_tokens

webdataset_writer = pytest.importorskip("webdataset")

BUCKET = "gaps"


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with loopback_s3(BUCKET) as (fs, _):
        yield fs


def _write(path: Path, samples: list[tuple[str, Path]]) -> None:
    """A shard as img2dataset writes one, with webdataset's own writer: KEY.ext, KEY.txt, KEY.json."""
    with webdataset_writer.TarWriter(str(path), encoder=False) as w:
        for key, media in samples:
            w.write({"__key__": key, media.suffix[1:]: media.read_bytes(), "txt": f"caption {key}".encode(),
                     "json": json.dumps({"key": key, "src": media.name}).encode()})


def _cut_inside(path: Path, member: str) -> int:
    """Cut the tar's bytes halfway into `member`'s data, as a download that stopped; the bytes kept."""
    with tarfile.open(path) as t:
        m = t.getmember(member)
    keep = m.offset_data + m.size // 2
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return keep


def _summary(result) -> dict:
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_gap_in_the_range_and_a_cut_tar_cost_only_their_own_rows(where, good, ckpt, tmp_path, request):
    files = sorted(good.iterdir())  # clip.mp4, photo0-3.jpg, small.png
    made = tmp_path / "made"
    made.mkdir()
    samples = {n: [(f"{n}{i:04d}", p) for i, p in enumerate(files[2 * n:2 * n + 2])] for n in range(3)}
    for n in range(3):
        _write(made / f"shard-{n:05d}.tar", samples[n])
    whole = {n: (made / f"shard-{n:05d}.tar").read_bytes() for n in range(3)}
    shards = tmp_path / "shards"
    shards.mkdir()
    # 00000 whole, 00001 missing, 00002 cut inside the second sample's media
    (shards / "shard-00000.tar").write_bytes(whole[0])
    cut_member = f"{samples[2][1][0]}{samples[2][1][1].suffix}"
    (shards / "shard-00002.tar").write_bytes(whole[2])
    kept = _cut_inside(shards / "shard-00002.tar", cut_member)
    out, args = tmp_path / "out", ["--model", ckpt, *BASE, "--workers", "0"]
    if where == "s3":
        fs = request.getfixturevalue("s3")
        prefix = f"{BUCKET}/{tmp_path.name}"
        fs.put([str(p) for p in sorted(shards.iterdir())], f"{prefix}/")
        root = f"s3://{prefix}"
    else:
        root = str(shards)
    pattern = f"{root}/shard-{{00000..00002}}.tar"

    first = encode([pattern, "-o", out, *args])
    assert first.exit_code == 1, first.output  # files failed: the gap and the cut
    assert _summary(first)["by_status"] == {"ok": 3, "not_found": 1, "unreadable": 2}
    rows, got = shard_tokens(out)
    by_path = {r["path"]: r for r in rows}
    gap = by_path[f"{root}/shard-00001.tar"]
    assert (gap["status"], gap["error"]) == ("not_found", f"not found: {pattern} names it; the range's other tars are encoded")
    cut = by_path[f"{root}/shard-00002.tar"]
    size = samples[2][1][1].stat().st_size
    with tarfile.open(made / "shard-00002.tar") as t:
        offset = t.getmember(cut_member).offset_data  # where the cut member's data begins
    assert cut["status"] == "unreadable" and cut["size"] == kept
    assert cut["error"] == (f"the tar ends at byte {kept:,}, {kept - offset:,} bytes into the {size:,} of "
                            f"{cut_member}: cut short (a download that stopped?)")
    member = by_path[f"{root}/shard-00002.tar/{cut_member}"]
    assert member["status"] == "unreadable" and member["size"] == kept - offset
    assert member["error"] == f"cut short: the tar holds {kept - offset:,} of its {size:,} bytes"
    # every whole member encoded, with its sidecars, to the tokens of the file itself
    want = _folder_tokens(good, ckpt, tmp_path)
    ok = {p: r for p, r in by_path.items() if r["status"] == "ok"}
    assert set(ok) == {f"{root}/shard-{n:05d}.tar/{k}{p.suffix}" for n in (0, 2) for k, p in samples[n]} - {
        f"{root}/shard-00002.tar/{cut_member}"}
    for path, row in ok.items():
        assert row["sidecar"]["txt"] == f"caption {Path(path).stem}"
        assert torch.equal(got[path], want[row["sidecar"]["json"]["src"]]), path

    lines = (out / "manifest.jsonl").read_text().count("\n")
    again = encode([pattern, "-o", out, *args])  # the same state: nothing to do, no row added
    assert _summary(again)["encoded"] == 0 and (out / "manifest.jsonl").read_text().count("\n") == lines

    # the downloads finish: the missing tar and the whole of the cut one; only what was missing is encoded
    if where == "s3":
        fs.pipe({f"{prefix}/shard-00001.tar": whole[1], f"{prefix}/shard-00002.tar": whole[2]})
        fs.invalidate_cache()
    else:
        (shards / "shard-00001.tar").write_bytes(whole[1])
        (shards / "shard-00002.tar").write_bytes(whole[2])
    done = encode([pattern, "-o", out, *args])
    assert done.exit_code == 0, done.output
    assert _summary(done)["encoded"] == 3
    rows, got = shard_tokens(out)
    latest = {r["path"]: r for r in rows}
    for n in range(3):
        for key, p in samples[n]:
            path = f"{root}/shard-{n:05d}.tar/{key}{p.suffix}"
            assert latest[path]["status"] == "ok" and torch.equal(got[path], want[p.name]), path


def _folder_tokens(good: Path, ckpt, tmp_path: Path) -> dict:
    out = tmp_path / "folder"
    assert encode([good, "-o", out, "--model", ckpt, *BASE, "--workers", "0"]).exit_code == 0
    rows, tokens = shard_tokens(out)
    return {Path(p).name: t for p, t in tokens.items()}


def test_a_tar_without_its_end_marker_and_a_range_with_no_tar(good, ckpt, tmp_path):
    """Cut right after a member (no end-of-archive marker): every member encoded, the cut recorded.
    A range none of whose tars exists is a typo: exit 2, one line."""
    files = sorted(good.iterdir())[1:3]
    tar = tmp_path / "shard-00000.tar"
    _write(tar, [(f"{i:04d}", p) for i, p in enumerate(files)])
    with tarfile.open(tar) as t:
        last = t.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512  # its padded data's end: the marker would follow
    tar.write_bytes(tar.read_bytes()[:end])
    out = tmp_path / "out"
    result = encode([tmp_path / "shard-{00000..00001}.tar", "-o", out, "--model", ckpt, *BASE, "--workers", "0"])
    assert result.exit_code == 1, result.output
    rows = {r["path"]: r for r in shard_tokens(out)[0]}
    assert sum(r["status"] == "ok" for r in rows.values()) == 2
    assert rows[str(tar)]["status"] == "unreadable" and rows[str(tar)]["error"] == (
        f"the tar ends at byte {end:,}, after {last.name}, without its end-of-archive marker: cut short "
        "(a download that stopped?) or damaged")
    assert rows[str(tmp_path / "shard-00001.tar")]["status"] == "not_found"

    typo = encode([tmp_path / "shart-{00000..00003}.tar", "-o", tmp_path / "o2", "--model", ckpt, *BASE])
    assert typo.exit_code == 2
    assert f"shart-{{00000..00003}}.tar: no such file or folder (none of its 4 names)" in typo.output
