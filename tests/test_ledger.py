"""Re-runs over folders that are mostly done: the ledger, the no-op path, compaction and --prune."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gemma4enc
from gemma4enc.commands.cli import app
from gemma4enc.media import discover as discover_module
from gemma4enc.output import compact as compacting
from gemma4enc.output.files import MANIFEST, line_of
from gemma4enc.output.ledger import Ledger
from gemma4enc.output.opening import open_out

from .helpers import BASE, encode, flags, photo, shard_tokens

RUN = CliRunner()


def photos(root: Path, n: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        photo(60 + 8 * i, 80, seed=i).save(root / f"p{i}.jpg", quality=90)
    return root


@pytest.fixture()
def done(ckpt, tmp_path):
    """A folder of 6 photos, encoded once: (media, out, tokens by path, the run's summary)."""
    media = photos(tmp_path / "media", 6)
    out = tmp_path / "out"
    result = encode([media, "-o", out, "--model", ckpt, *BASE])
    assert result.exit_code == 0, result.output
    return media, out, shard_tokens(out)[1], json.loads(result.stdout)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]


def test_a_no_op_rerun_imports_no_torch_and_starts_no_worker(done, ckpt):
    media, out, _, first = done
    script = (
        "import json, multiprocessing, multiprocessing.forkserver, sys\n"
        "from gemma4enc.commands.cli import app\n"
        f"args = ['encode', {str(media)!r}, '-o', {str(out)!r}, '--model', {str(ckpt)!r}, *{BASE!r}]\n"
        "try:\n    app(args)\nexcept SystemExit as e:\n    code = e.code\n"
        "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules,"
        " 'children': len(multiprocessing.active_children()),"
        " 'forkserver': multiprocessing.forkserver._forkserver._forkserver_pid is not None}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout[: result.stdout.rindex("\n{")])
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts == {"code": 0, "torch": False, "transformers": False, "children": 0, "forkserver": False}, result.stderr
    assert summary["done_before"] == 6 and summary["encoded"] == 0 and summary["max_batch_patches"] == 0
    assert set(summary) == set(first)  # the same shape as a run that worked


def test_only_changed_files_are_opened_and_encoded(done, ckpt, monkeypatch):
    media, out, before, _ = done
    sniffed = []
    real = discover_module.kind_of
    monkeypatch.setattr(discover_module, "kind_of", lambda path, head: sniffed.append(path) or real(path, head))
    photo(50, 50, seed=40).save(media / "p1.jpg", quality=90)  # changed content (size and mtime)
    photo(70, 90, seed=41).save(media / "p3.jpg", quality=90)
    photo(30, 40, seed=42).save(media / "new.jpg", quality=90)
    result = encode([media, "-o", out, "--model", ckpt, *BASE])
    summary = json.loads(result.stdout)
    changed = {str(media / n) for n in ("p1.jpg", "p3.jpg", "new.jpg")}
    assert set(sniffed) == changed
    assert summary["done_before"] == 4 and summary["encoded"] == 3 and summary["failed"] == 0
    rows = lines(out)
    assert [r["path"] for r in rows[6:]] == sorted(changed)  # appended rows: the changed files only
    after = shard_tokens(out)[1]
    for path in set(before) - changed:
        assert torch.equal(after[path], before[path])  # what did not change keeps its tokens
    assert set(after) == set(before) | changed


def test_verify_groups_the_ok_rows_by_shard_in_arrays(tmp_path):
    rows = [("/a", "ok", "s1", 0), ("/b", "ok", "s2", 0), ("/c", "ok", "s1", 1), ("/d", "ok", None, None),
            ("/e", "decode_error", None, None), ("/f", "ok", "s2", 1), ("/f", "shard_lost", None, None),
            ("/g", "ok", "s1", -1), ("/a", "ok", "s1", 2)]  # /f lost, /a's later row wins
    lines = [line_of({"path": p, "size": 1, "mtime_ns": 1, "kind": "image", "status": st, "shard": sh, "index": i})
             for p, st, sh, i in rows]
    (tmp_path / MANIFEST).write_bytes(b"".join(lines))
    at = [sum(map(len, lines[:k])) for k in range(len(lines))]
    ledger = Ledger.load(tmp_path)
    by_shard, unplaced = ledger.ok_by_shard()
    assert {k: v.tolist() for k, v in by_shard.items()} == {"s1": [at[2], at[8]], "s2": [at[1]]}
    assert unplaced == ["/d"] and ledger.unreadable == 1  # /g's index -1 is no row a reader can act on
    (tmp_path / MANIFEST).write_bytes(lines[4])
    assert Ledger.load(tmp_path).ok_by_shard() == ({}, [])  # no ok row at all


def test_ledger_reads_on_and_starts_over(tmp_path):
    out = tmp_path
    (out / MANIFEST).write_bytes(b'{"path": "/a", "size": 1, "mtime_ns": 2, "status": "ok", "kind": "image"}\n'
                                 b'not json\n{"path": "/a", "size": 3, "mtime_ns": 4, "status": "failed",'
                                 b' "kind": "image"}\n{"path": "/b", "si')
    ledger = Ledger.load(out)
    assert len(ledger) == 1 and ledger.get("/a").size == 3 and ledger.get("/a").status == "failed"
    assert (ledger.superseded, ledger.unreadable) == (1, 1) and ledger.end < (out / MANIFEST).stat().st_size
    assert ledger.known_kind("/a", 3, 4) == "image" and ledger.known_kind("/a", 3, 5) is None
    with open(out / MANIFEST, "ab") as f:  # the torn line completed, one more appended
        f.write(b'ze": 5, "mtime_ns": 6, "status": "ok", "kind": "video", "shard": "s", "index": 0}\n')
    ledger.refresh()
    assert set(ledger) == {"/a", "/b"} and ledger.row("/b")["kind"] == "video" and ledger.shards() == {"s"}
    (out / MANIFEST).write_bytes(b'{"path": "/c", "size": 1, "mtime_ns": 1, "status": "ok", "kind": "image"}\n')
    assert set(ledger.refresh()) == {"/c"}  # a replaced (smaller) manifest is read anew


def test_compact_keeps_one_row_per_file_and_prune_drops_tokens(done, ckpt):
    media, out, before, _ = done
    photo(50, 50, seed=40).save(media / "p1.jpg", quality=90)
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    (media / "p2.jpg").unlink()
    (media / "p4.jpg").unlink()
    rows_before = lines(out)
    assert len(rows_before) == 7
    tokens = shard_tokens(out)[1]
    result = RUN.invoke(app, ["compact", str(out), "--json"])
    assert result.exit_code == 0, result.output
    rows = lines(out)
    assert len(rows) == len({r["path"] for r in rows}) == 6 and json.loads(result.stdout)["rows_after"] == 6
    assert verify_ok(out)
    result = RUN.invoke(app, ["compact", str(out), "--prune", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["pruned"] == 2 and report["shards_rewritten"] >= 1
    rows = lines(out)
    gone = {str(media / "p2.jpg"), str(media / "p4.jpg")}
    assert {r["path"] for r in rows} == set(tokens) - gone
    assert verify_ok(out)
    emb = gemma4enc.open(out)
    for path in set(tokens) - gone:
        assert torch.equal(emb[path], tokens[path].to(emb[path].dtype))
    named = {r["shard"] for r in rows}
    assert named == {p.name for p in out.glob("shard-*.safetensors")}  # old shards removed
    again = encode([media, "-o", out, "--model", ckpt, *BASE])  # resume still sees every file done
    assert json.loads(again.stdout)["encoded"] == 0 and json.loads(again.stdout)["done_before"] == 4


def test_a_killed_prune_leaves_a_valid_folder(done, monkeypatch):
    media, out, tokens, _ = done
    (media / "p0.jpg").unlink()
    manifest_before = (out / MANIFEST).read_bytes()
    real = compacting.atomic_write

    def die_on_manifest(path, write):
        if path.name == MANIFEST:
            raise KeyboardInterrupt  # killed after the new shards, before the manifest was replaced
        real(path, write)

    monkeypatch.setattr(compacting, "atomic_write", die_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        open_out(out).compact(prune=True)
    assert (out / MANIFEST).read_bytes() == manifest_before
    report = json.loads(RUN.invoke(app, ["verify", str(out), "--json"]).stdout)
    assert report["ok"] and report["orphan_shards"]  # the half-done copy is an orphan, nothing else
    emb = gemma4enc.open(out)
    assert all(torch.equal(emb[p], t.to(emb[p].dtype)) for p, t in tokens.items())


def test_a_run_compacts_past_the_threshold(done, ckpt, monkeypatch):
    media, out, _, _ = done
    from gemma4enc.output import out as outs

    monkeypatch.setattr(outs, "AUTO_COMPACT_ROWS", 2)
    for i in range(4):  # 4 of 6 rows superseded: more dead than live… not yet; then 8 of 6
        photo(50, 50 + i, seed=50 + i).save(media / f"p{i}.jpg", quality=90)
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    assert len(lines(out)) == 10
    for i in range(4):
        os.utime(media / f"p{i}.jpg", ns=(1, 10**18 + i))
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    rows = lines(out)
    assert len(rows) == len({r["path"] for r in rows}) == 6 and verify_ok(out)


def verify_ok(out: Path) -> bool:
    result = RUN.invoke(app, ["verify", str(out), "--json"])
    report = json.loads(result.stdout)
    return result.exit_code == 0 and report["ok"] and not report["orphan_shards"]


def test_plan_reads_headers_of_new_files_only(done, monkeypatch):
    media, out, _, _ = done
    shutil.copy(media / "p0.jpg", media / "copy.jpg")
    result = RUN.invoke(app, ["plan", str(media), "--out", str(out), "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert report["done_before"] == 6 and report["files"] == 1 and report["tower_items"] == 1


def test_plan_out_plans_with_the_settings_out_records(ckpt, tmp_path):
    media, out = photos(tmp_path / "media", 2), tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *flags(max_soft_tokens=70, out_dtype="float16")]).exit_code == 0
    photo(300, 200, seed=9).save(media / "new.jpg", quality=90)
    result = RUN.invoke(app, ["plan", str(media), "--out", str(out), "--json"])  # no token or dtype flag
    report = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert report["files"] == 1 and report["tokens"] <= 70  # OUT's budget, not the default 280
    assert "as " in result.stderr and "image_tokens 70" in result.stderr
    plain = json.loads(RUN.invoke(app, ["plan", str(media / "new.jpg"), "--json"]).stdout)
    assert plain["tokens"] > 70


PROBE = '''
import sys
from gemma4enc.media.prepare import prepare

def probe(item, options):
    before = [m for m in ("torch", "transformers") if m in sys.modules]
    d = prepare(item, options)  # decoding and patchifying a photo must not import them either
    d.error = repr(before + [m for m in ("torch", "transformers") if m in sys.modules])
    return d
'''


def test_decode_workers_start_without_torch_or_transformers(tmp_path, monkeypatch):
    """Workers start from a forkserver that preloads only our decoders (started early, taken over by map)."""
    from gemma4enc.media.discover import look
    from gemma4enc.media.workers import DecodePool
    from gemma4enc.options import Options

    (tmp_path / "ledger_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from ledger_probe import probe

    photos(tmp_path / "m", 2)
    pool = DecodePool(Options(), workers=2, fn=probe).start()
    try:
        results = list(pool.map([look(str(p)) for p in sorted((tmp_path / "m").iterdir())]))
    finally:
        pool.close()
    assert [r.status for r in results] == ["ok", "ok"] and all(r.patches for r in results)
    assert {r.error for r in results} == {"[]"}


def test_a_fresh_run_starts_its_workers_before_torch_loads_and_closes_them(ckpt, tmp_path, monkeypatch):
    """A new output folder surely has work: its decode workers start before preflight (which imports
    torch) and the engine takes them over; a bad model still leaves no worker behind."""
    from gemma4enc.media import workers
    from gemma4enc.run import preflight as preflight_module

    events = []
    real_start, real_preflight, real_map = workers.DecodePool.start, preflight_module.preflight, workers.DecodePool.map
    monkeypatch.setattr(workers.DecodePool, "start", lambda pool, **k: events.append("start") or real_start(pool, **k))
    monkeypatch.setattr(workers.DecodePool, "map", lambda pool, items: events.append("map") or real_map(pool, items))
    monkeypatch.setattr(preflight_module, "preflight", lambda *a, **k: events.append("preflight") or real_preflight(*a, **k))
    media = photos(tmp_path / "media", 2)
    result = encode([media, "-o", tmp_path / "out", "--model", ckpt, *BASE])
    assert result.exit_code == 0 and json.loads(result.stdout)["encoded"] == 2, result.output
    assert events == ["start", "preflight", "map"]  # one pool, started first, used by the engine
    events.clear()
    bad = encode([media, "-o", tmp_path / "out2", "--model", tmp_path / "no-model", *BASE])
    assert bad.exit_code != 0 and events == ["start", "preflight"]
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name == "gemma4enc-decode"]


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_run_calls_preflight_once(ckpt, tmp_path, monkeypatch, dtype):
    """Once a run: before OUT is touched, or on a re-run whose check can wait, once it has work."""
    from gemma4enc.run import preflight as preflight_module

    calls = []
    real = preflight_module.preflight
    monkeypatch.setattr(preflight_module, "preflight", lambda *a, **k: calls.append(1) or real(*a, **k))
    media, out = photos(tmp_path / "media", 2), tmp_path / "out"
    argv = [media, "-o", out, "--model", ckpt, *flags(dtype=dtype)]
    assert encode(argv).exit_code == 0 and len(calls) == 1
    photo(40, 40, seed=7).save(media / "new.jpg")
    calls.clear()
    assert json.loads(encode(argv).stdout)["encoded"] == 1 and len(calls) == 1
    calls.clear()
    assert json.loads(encode(argv).stdout)["encoded"] == 0 and len(calls) == (0 if dtype != "auto" else 1)


def test_a_compacted_folder_adopts_a_moved_root_and_heals_a_lost_shard(done, ckpt, tmp_path):
    """Compaction (rows copied, some moved to rewritten shards) keeps what adoption and healing need."""
    media, out, before, _ = done
    (media / "p2.jpg").unlink()
    assert json.loads(RUN.invoke(app, ["compact", str(out), "--prune", "--json"]).stdout)["shards_rewritten"] >= 1
    moved = tmp_path / "disk2" / "media"
    moved.parent.mkdir()
    shutil.move(media, moved)  # a rename keeps the mtimes
    again = encode([moved, "-o", out, "--model", ckpt, *BASE])
    summary = json.loads(again.stdout)
    assert again.exit_code == 0 and summary["encoded"] == 0 and summary["done_before"] == 5, again.output
    emb = gemma4enc.open(out)
    for name in ("p0.jpg", "p1.jpg", "p3.jpg", "p4.jpg", "p5.jpg"):
        row = emb.row(moved / name)
        assert row["root"] == str(moved) and row["rel"] == name
        assert torch.equal(emb[moved / name], before[str(media / name)].to(emb[moved / name].dtype))
    victim = out / emb.row(moved / "p0.jpg")["shard"]
    held = {p for p in emb if p.startswith(str(moved)) and emb.row(p)["shard"] == victim.name}
    victim.unlink()
    healed = encode([moved, "-o", out, "--model", ckpt, *BASE])
    assert healed.exit_code == 0 and json.loads(healed.stdout)["encoded"] == len(held) >= 1, healed.output
    assert any(r["status"] == "shard_lost" for r in lines(out))  # superseded, then encoded again
    emb = gemma4enc.open(out)
    assert {str(moved / n) for n in ("p0.jpg", "p1.jpg", "p3.jpg", "p4.jpg", "p5.jpg")} <= set(emb)
    assert not any(emb.row(p)["shard"] == victim.name for p in emb)  # old paths' rows into it are lost too
    assert verify_ok(out)


def _manifest(out: Path, rows: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_bytes(b"".join(line_of(r) for r in rows))
    return out


def test_the_ledger_holds_more_than_65535_shard_names(tmp_path):
    """Codes are 4 bytes: shard names past the 2-byte boundary keep their own status and kind."""
    n = 70_000
    rows = [{"path": f"/m/{i}.jpg", "kind": "image", "size": i, "mtime_ns": 1, "status": "ok", "shard": f"s{i}",
             "index": 0, "tokens": 1} for i in range(n)]
    rows.append({"path": "/m/last.mp4", "kind": "video", "size": 3, "mtime_ns": 2, "status": "timeout", "shard": None,
                 "index": None, "tokens": 0})
    ledger = Ledger.load(_manifest(tmp_path, rows))
    assert len(ledger) == n + 1 and len(ledger.shards()) == n
    assert ledger.get("/m/69999.jpg")[:7] == (69999, 1, ledger.get("/m/69999.jpg").offset, 1, 0, "s69999", "ok")
    assert (ledger.get("/m/last.mp4").status, ledger.get("/m/last.mp4").kind) == ("timeout", "video")


def test_paths_that_share_a_hash_stay_apart(tmp_path, monkeypatch):
    """Lookups compare the stored path, so a hash collision (forced here) mixes no rows up."""
    from gemma4enc.output import ledger as module

    monkeypatch.setattr(module, "hash", lambda path: 7, raising=False)
    rows = [{"path": p, "kind": "image", "size": s, "mtime_ns": 1, "status": "ok", "shard": "a", "index": s,
             "tokens": 1} for p, s in (("/a/x.jpg", 1), ("/b/y\udcff.jpg", 2), ("/a/x.jpg", 3), ("z", 4))]
    ledger = Ledger.load(_manifest(tmp_path, rows))
    assert [(p, e.size) for p, e in ledger.entries()] == [("/a/x.jpg", 3), ("/b/y\udcff.jpg", 2), ("z", 4)]
    assert ledger.superseded == 1 and ledger.get("/a/y.jpg") is None and "z" in ledger
    assert list(ledger.live_offsets()) == sorted(e.offset for _, e in ledger.entries())


def test_rows_we_did_not_write_are_skipped_whole(tmp_path):
    rows = [{"path": "/a.jpg", "size": 1, "status": "ok", "tokens": -1}, {"path": 5}, {"path": "/a.jpg", "size": 2,
            "status": "ok", "index": 2**40}, {"path": "/b.jpg", "size": 3, "status": "ok", "sha256": "00" * 31 + "01"}]
    ledger = Ledger.load(_manifest(tmp_path, rows))
    assert (len(ledger), ledger.unreadable, ledger.get("/b.jpg").size) == (1, 3, 3)
    assert ledger.digest("/b.jpg") == "00" * 31 + "01"


def test_roots_walked_lazily_keep_their_own_root_and_rel(tmp_path):
    """Discovery walks each root as it stats (no list of every path first); each item keeps its own root."""
    for root, name in (("a", "x.jpg"), ("bb", "y.jpg")):
        photos(tmp_path / root / "sub", 1)
        (tmp_path / root / "sub" / "p0.jpg").rename(tmp_path / root / "sub" / name)
    items, _ = discover_module.discover([str(tmp_path / "a"), str(tmp_path / "bb")])
    got = [(Path(i.root).name, i.rel) for i in items if i.rel]
    assert got == [("a", "sub/x.jpg"), ("bb", "sub/y.jpg")]
