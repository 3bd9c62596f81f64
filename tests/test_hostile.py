"""Hostile input (issue 44, docs/security.md): an OUT someone hands over, and names chosen by
whoever can write to a media folder, must never make gemma4enc write, delete or leak outside
what it owns. Each case plants decoys in the test's own folder, outside OUT, and checks that
they are byte-identical afterwards, that the command ends in one line (no traceback, never
exit 70), and that the rest of OUT stays usable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gemma4enc.commands.cli import app

from .helpers import BASE, RUN, encode, flags, photo

OWN = ["manifest.jsonl", "gemma4enc.lock", "search-index.json", "search-index.vectors",
       "search-index.paths", "search-index.lock"]


@pytest.fixture(scope="module")
def pics(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile") / "media"
    root.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80), (48, 120)]):
        photo(h, w, seed=i).save(root / f"p{i}.png")
    photo(64, 96, seed=0).save(root / "copy.png")  # a duplicate of p0, for --duplicates
    return root


@pytest.fixture(scope="module")
def made(pics, ckpt, tmp_path_factory):
    """A good OUT of `pics`, copied afresh by each test that makes it hostile."""
    out = tmp_path_factory.mktemp("made") / "out"
    assert encode([pics, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    return out


def copy_out(made: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(made, dest)
    return dest


def decoy(folder: Path, name: str) -> Path:
    p = folder / name
    p.write_bytes(b"# a user's own file: must stay as it is\nexport PATH=$PATH\n")
    return p


def no_crash(result) -> None:
    assert result.exit_code != 70 and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("name", OWN)
def test_outs_own_files_are_never_written_through_a_link(made, pics, ckpt, tmp_path, name):
    """A handed-over OUT whose own file links to a user's file: encode (with a new file to add),
    compact and search --duplicates refuse or go on, but never write the linked file."""
    out = copy_out(made, tmp_path / "out")
    target = decoy(tmp_path, "bashrc")
    before = target.read_bytes()
    real = out / name
    if name == "manifest.jsonl":
        os.rename(real, tmp_path / "real-manifest")
    else:
        real.unlink(missing_ok=True)
    os.symlink(target, real)
    media = tmp_path / "media"
    media.mkdir()
    for p in pics.iterdir():
        (media / p.name).write_bytes(p.read_bytes())
    photo(70, 70, seed=9).save(media / "$(touch PWNED).png")
    results = [
        encode([media, "-o", out, "--model", ckpt, *BASE]),
        RUN.invoke(app, ["compact", str(out)]),
        RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--json"]),
    ]
    for r in results:
        no_crash(r)
    assert target.read_bytes() == before, [r.output for r in results]
    if name in ("manifest.jsonl", "gemma4enc.lock"):  # the runs that need it said why, in one line
        assert all(r.exit_code == 2 and f"{name} is a symbolic link" in r.output for r in results[:2]), [
            r.output for r in results]


def test_a_fifo_in_out_blocks_nothing(made, ckpt, pics, tmp_path):
    """A FIFO planted as OUT's lock: the run refuses it at once rather than wait for a writer."""
    out = copy_out(made, tmp_path / "out")
    os.mkfifo(out / "gemma4enc.lock")
    r = encode([pics, "-o", out, "--model", ckpt, *BASE])
    no_crash(r)
    assert r.exit_code == 2 and "not a regular file" in r.output, r.output


def test_temp_names_cannot_be_planted(made, pics, ckpt, tmp_path):
    """Links planted under every temp name the next pids would use (.gemma4enc-NAME.PID.tmp, and the
    write test's) are never written through: the temp names are random."""
    out = copy_out(made, tmp_path / "out")
    target = decoy(tmp_path, "precious")
    before = target.read_bytes()
    pid = os.getpid()
    for n in ["write-test", "manifest.jsonl", "settings.json", "shard-000001.safetensors",
              "search-index.rows.npy", "search-index.json"]:
        for p in range(pid - 5, pid + 200):
            os.symlink(target, out / f".gemma4enc-{n}.{p}.tmp")
    (pics.parent / "new").mkdir(exist_ok=True)
    media = tmp_path / "media"
    media.mkdir()
    photo(72, 90, seed=11).save(media / "new.png")
    results = [
        encode([media, "-o", out, "--model", ckpt, *BASE]),
        RUN.invoke(app, ["compact", str(out), "--prune"]),
        RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--json"]),
    ]
    for r in results:
        no_crash(r)
        assert r.exit_code in (0, 1), r.output
    assert target.read_bytes() == before
    assert json.loads(results[0].stdout)["encoded"] == 1


SECRET = "hunter2-s3cr3t"


def test_credentials_in_urls_are_refused_and_never_echoed(made, ckpt, tmp_path):
    """userinfo in an input URL, in --files-from, or in OUT's URL: exit 2 in one line, the secret in
    no output (it would otherwise land in the manifest and the exports people share)."""
    listed = tmp_path / "list.txt"
    listed.write_text(f"https://me:{SECRET}@127.0.0.1:9/a.jpg\n")
    runs = [
        encode([f"http://me:{SECRET}@127.0.0.1:9/a.jpg", "-o", tmp_path / "o1", "--model", ckpt, *BASE]),
        encode(["--files-from", listed, "-o", tmp_path / "o2", "--model", ckpt, *BASE]),
        encode([made.parent, "-o", f"s3://id:{SECRET}@bucket/out", "--model", ckpt, *BASE]),
    ]
    for r in runs:
        no_crash(r)
        assert r.exit_code == 2 and "credentials" in r.output and "***@" in r.output, r.output
        assert SECRET not in r.output
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_closed_pipe_is_not_a_bug(made, pics):
    """`gemma4enc search OUT FILE | head -1`: the reader went away; no traceback, no exit 70."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "gemma4enc", "search", str(made), str(pics / "p0.png")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before it writes: its first write meets a pipe nobody reads
    _, err = p.communicate(timeout=300)
    assert p.returncode == 141 and b"Traceback" not in err and b"internal error" not in err, err


def test_absurd_workers_are_refused_and_few_files_start_few(pics, ckpt, tmp_path):
    """--workers 1000000000000 was a fork bomb (4,383 processes for one file)."""
    r = encode([pics, "-o", tmp_path / "out", "--model", ckpt, *BASE, "--workers", "1000000000000"])
    no_crash(r)
    assert r.exit_code == 2 and "--workers 1000000000000: at most" in r.output, r.output
    from gemma4enc.media import workers

    started = []
    real = workers._Worker.__init__

    def count(self, *args, **kwargs):
        started.append(1)
        real(self, *args, **kwargs)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as m:
        m.setattr(workers._Worker, "__init__", count)
        one = tmp_path / "one"
        one.mkdir()
        photo(50, 50, seed=3).save(one / "a.png")
        cap = 4 * (os.cpu_count() or 1)
        r = encode([one, "-o", tmp_path / "out1", "--model", ckpt, *BASE, "--workers", str(cap)])
    assert r.exit_code == 0, r.output
    assert len(started) == 1  # one file, one worker


BAD_ROWS = [
    lambda ok: ok | {"path": "/elsewhere/minus.png", "index": -2},  # counted from the end: another file's
    lambda ok: ok | {"path": "/elsewhere/far.png", "index": 10**6},
    lambda ok: ok | {"path": "/elsewhere/up.png", "shard": "../../etc/shard-000000.safetensors"},
    lambda ok: ok | {"path": "/elsewhere/hash.png", "sha256": "zz"},
    lambda ok: {"path": "/x"},
    lambda ok: ok | {"path": "/elsewhere/str.png", "index": "0"},
]


@pytest.mark.parametrize("bad", range(len(BAD_ROWS)))
def test_a_hostile_manifest_row_is_left_out_never_read(made, tmp_path, bad):
    """One bad row: no reader hands out tokens for it (never another file's), no command exits 70,
    the rest of OUT stays usable, and verify --repair gets past it."""
    import gemma4enc

    out = copy_out(made, tmp_path / "out")
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    hostile = BAD_ROWS[bad](next(r for r in rows if r["status"] == "ok"))
    with open(out / "manifest.jsonl", "a") as f:
        f.write(json.dumps(hostile) + "\n")
    from gemma4enc.errors import UsageError

    for framework in ("pt", "numpy"):
        emb = gemma4enc.open(out, framework=framework)
        with pytest.raises((KeyError, UsageError)):  # absent, or refused naming verify --repair
            emb[hostile["path"]]
        others = [p for p, _ in emb.ok_rows() if p != hostile["path"]]
        assert len(others) == 4 and all(len(emb[p]) for p in others)  # the others read as before
    for args in (["inspect", str(out), "--json"], ["search", str(out), "--duplicates", "--json"],
                 ["export", str(out), str(tmp_path / "e1"), "--to", "parquet"],
                 ["export", str(out), str(tmp_path / "e2"), "--to", "vllm"],
                 ["verify", str(out), "--repair"], ["verify", str(out)]):
        r = RUN.invoke(app, args)
        no_crash(r)
        assert r.exit_code in (0, 1) or (r.exit_code == 2 and "--repair" in r.output), (args, r.output)
    assert RUN.invoke(app, ["verify", str(out)]).exit_code == 0  # repaired: the rest of OUT whole


def test_a_hostile_shard_header_is_one_line(made, tmp_path):
    """A shard whose header claims 2^63 bytes, or offsets past its end: the numpy reader and search
    say which shard and how to mend it (exit 2), never a MemoryError or exit 70."""
    import gemma4enc

    for case in ("huge", "past"):
        out = copy_out(made, tmp_path / case)
        shard = sorted(out.glob("shard-*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        if case == "huge":
            data[:8] = (1 << 63).to_bytes(8, "little")
        else:
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + n])
            header["tokens"]["data_offsets"] = [0, 10**12]
            text = json.dumps(header).encode()
            data = len(text).to_bytes(8, "little") + text + data[8 + n:]
        shard.write_bytes(bytes(data))
        emb = gemma4enc.open(out, framework="numpy")
        path = next(p for p, r in emb.ok_rows() if r["shard"] == shard.name)
        from gemma4enc.errors import UsageError

        with pytest.raises(UsageError, match="verify OUT --repair"):
            emb[path]
        r = RUN.invoke(app, ["search", str(out), "--duplicates", "--json"])
        no_crash(r)


def test_a_name_that_is_not_utf8_denies_no_export(pics, ckpt, tmp_path):
    """One file name that is not UTF-8 made every export exit 70 (UnicodeEncodeError); now each
    export holds it, its undecodable bytes as \\xNN escapes, and the groups' Parquet too."""
    import pyarrow.parquet as pq

    media = tmp_path / "media"
    media.mkdir()
    for p in pics.iterdir():
        (media / p.name).write_bytes(p.read_bytes())
    odd = os.fsencode(media) + b"/caf\xe9.png"  # Latin-1 é: not UTF-8
    with open(odd, "wb") as f:
        f.write((pics / "p0.png").read_bytes())
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    want = os.fsdecode(odd).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    assert want.endswith("caf\\xe9.png")
    for to in ("clip", "parquet", "webdataset", "lance"):
        r = RUN.invoke(app, ["export", str(out), str(tmp_path / to), "--to", to])
        no_crash(r)
        assert r.exit_code == 0, (to, r.output)
    assert want in pq.read_table(tmp_path / "parquet" / "data").column("path").to_pylist()
    r = RUN.invoke(app, ["search", str(out), "--duplicates", "-q", "--groups", str(tmp_path / "g.parquet")])
    assert r.exit_code == 0, r.output
    assert want in pq.read_table(tmp_path / "g.parquet").column("members").to_pylist()[0]


def _tar_of(path: Path, members: list) -> None:
    """A tar written member by member: (name, bytes) regular files, or a ready TarInfo (links,
    devices, FIFOs), as a hostile publisher could."""
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                t.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size, info.mtime = len(m[1]), 1_700_000_000
                t.addfile(info, io.BytesIO(m[1]))


def test_hostile_tar_members_get_rows_never_paths_outside(pics, ckpt, tmp_path):
    """Members named with '..', absolutely or with control characters are refused with a row whose
    path stays inside the tar; links, devices and FIFOs get a row saying what they are; of two
    members with one name the later is encoded under it (as tar -x keeps it) and the earlier is a
    row of its own. Nothing is written outside OUT, and a re-run adds no row."""
    import hashlib
    import tarfile

    png = {p.name: p.read_bytes() for p in pics.iterdir()}
    specials = []
    for name, kind, target in [("link.png", tarfile.SYMTYPE, "/etc/passwd"), ("hard.png", tarfile.LNKTYPE, "000001.png"),
                               ("dev.png", tarfile.CHRTYPE, ""), ("pipe.png", tarfile.FIFOTYPE, "")]:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        specials.append(info)
    tar = tmp_path / "web.tar"
    _tar_of(tar, [("000001.png", png["p0.png"]), ("../../escape.png", png["p1.png"]), ("/abs.png", png["p1.png"]),
                  ("x\x1b[31mred\n.png", png["p1.png"]), ("dup.png", png["p1.png"]), *specials,
                  ("dup.png", png["p2.png"])])
    decoys = [decoy(tmp_path, "escape.png"), decoy(tmp_path.parent, "escape.png")]
    before = [d.read_bytes() for d in decoys]
    out = tmp_path / "out"
    r = encode([tar, "-o", out, "--model", ckpt, "--hash", *BASE])
    no_crash(r)
    assert r.exit_code == 1, r.output  # some files failed: the refused members
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    by = {row["path"][len(str(tar)) + 1:]: row for row in rows}
    assert by["000001.png"]["status"] == "ok"
    assert by["dup.png"]["status"] == "ok"
    assert by["dup.png"]["sha256"] == hashlib.sha256(png["p2.png"]).hexdigest()  # the later member
    earlier = [k for k in by if k.startswith("dup.png@")]
    assert len(earlier) == 1 and "later member" in by[earlier[0]]["error"]
    for name, word in [("link.png", "symbolic link"), ("hard.png", "hard link"), ("dev.png", "character device"),
                       ("pipe.png", "FIFO")]:
        assert by[name]["status"] == "unsupported" and word in by[name]["error"], by[name]
    refused = [row for row in rows if "refused" in (row.get("error") or "")]
    assert len(refused) == 3, refused
    for row in rows:
        rel = row["path"][len(str(tar)) + 1:]
        assert row["path"].startswith(f"{tar}/") and ".." not in rel.split("/") and not rel.startswith("/")
        assert all(c.isprintable() for c in row["path"]) and all(c.isprintable() for c in row.get("error") or "")
        assert os.path.normpath(row["path"]).startswith(str(tar) + "/")
    assert [d.read_bytes() for d in decoys] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["escape.png", "out", "web.tar"]
    again = encode([tar, "-o", out, "--model", ckpt, "--hash", *BASE])
    assert again.exit_code == 0, again.output
    assert len((out / "manifest.jsonl").read_text().splitlines()) == len(rows)


# a child's peak resident bytes: VmHWM starts again at exec (ru_maxrss keeps the forking parent's)
PEAK = "next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))"


def _whole_16bit(image):
    """to_rgb's 16-bit rule as it was, over the whole image at once: the banded one must equal it."""
    import numpy as np
    from PIL import Image

    raw = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") or raw.max() > 255 else 255.0
    array = np.clip(raw * (255.0 / top), 0, 255).round().astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int):
        array[raw == key] = 255
    return Image.fromarray(array, "L").convert("RGB")


def test_16bit_and_float_images_scale_in_bands_exactly(monkeypatch):
    """Bands of a few rows (edges crossing every band) give the same bytes as the whole-image
    float64 rule did, 16-bit with a tRNS key, 32-bit integer and float (NaN left out)."""
    import numpy as np
    from PIL import Image

    from gemma4enc.media import image as img

    monkeypatch.setattr(img, "BAND_PIXELS", 7 * 53)  # bands of 7 rows
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 65536, (61, 53)).astype(np.uint16)
    i16 = Image.fromarray(wide)
    i16.info["transparency"] = int(wide[30, 30])
    i32 = Image.fromarray(rng.integers(0, 1000, (61, 53)).astype(np.int32), "I")
    assert np.array_equal(np.asarray(img.to_rgb(i16)), np.asarray(_whole_16bit(i16)))
    assert np.array_equal(np.asarray(img.to_rgb(i32)), np.asarray(_whole_16bit(i32)))
    floats = rng.normal(size=(61, 53)).astype(np.float32)
    floats[3, 3] = np.nan
    f = Image.fromarray(floats, "F")
    lo, hi = float(np.nanmin(floats)), float(np.nanmax(floats))
    want = ((np.asarray(f, dtype=np.float64) - lo) * (255.0 / (hi - lo))).astype(np.uint8)
    got = np.asarray(img.to_rgb(f))[..., 0]
    ok = ~np.isnan(floats)
    assert np.array_equal(got[ok], want[ok])


@pytest.mark.slow
def test_a_huge_16bit_png_decodes_within_its_bound(tmp_path):
    """A 176 KB 16-bit PNG of 88 M pixels (under the default --max-image-pixels) peaked at 2.4 GB in
    float64; scaled in bands it stays under 12 bytes a pixel (measured 799 MB, docs/security.md)."""
    import subprocess
    import sys

    import numpy as np
    from PIL import Image

    a = np.zeros((8000, 11000), np.uint16)
    a[::7] = 40000
    png = tmp_path / "big16.png"
    Image.fromarray(a).save(png)
    del a
    code = ("import sys\nfrom gemma4enc.media.image import decode_image\n"
            "f = decode_image(sys.argv[1], 89_478_485, None)\nassert f.images[0].size == (11000, 8000)\n"
            f"print({PEAK})")
    r = subprocess.run([sys.executable, "-c", code, str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < 12 * 88_000_000, int(r.stdout) / 1e6


@pytest.mark.parametrize("args", [["--frames", "1000000"], ["--fps", "30", "--max-frames", "9000"],
                                  ["--frames", "600", "--video-soft-tokens", "1120"]])
def test_frames_past_the_bytes_one_file_may_decode_to_are_refused(pics, tmp_path, args):
    """--frames 1000000 on a 4.5 MB video grew a worker without bound: refused in one line, exit 2,
    before anything starts; the cap is in bytes, so it depends on the frames' soft tokens."""
    r = RUN.invoke(app, ["encode", str(pics), "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and "GiB one file may decode to" in r.output, r.output
    assert not (tmp_path / "out").exists()
    from gemma4enc.options import Options, Sampling

    Options(model="m", sampling=Sampling(frames=543), video_tokens=1120)  # just under: taken


@pytest.mark.slow
def test_a_huge_manifest_line_is_read_with_a_bound(made, tmp_path):
    """A 100 MB line in a handed-over manifest (a list of 50 M numbers: gigabytes once parsed) is
    no row: inspect, verify --repair and compact count it unreadable without holding it, and the
    rest of OUT reads as before."""
    import subprocess
    import sys

    out = copy_out(made, tmp_path / "out")
    rows = (out / "manifest.jsonl").read_bytes()
    with open(out / "manifest.jsonl", "ab") as f:
        f.write(b'{"path": "/x.png", "pad": [' + b"0," * 50_000_000 + b'0]}\n')
    code = ("import sys\nfrom gemma4enc.commands.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            f"print(code, {PEAK}, file=sys.stderr)")
    for args in (["inspect", str(out), "--json"], ["verify", str(out), "--repair"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
        exit_code, peak = map(int, r.stderr.split()[-2:])
        assert exit_code in (0, 1) and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert peak < 400_000_000, (args, peak / 1e6)
    assert RUN.invoke(app, ["compact", str(out)]).exit_code == 0
    assert (out / "manifest.jsonl").read_bytes() == rows  # the line is gone, every row kept


def test_a_stale_lock_is_not_a_live_run_and_a_held_one_prints_plain(made, pics, tmp_path):
    """A lock file naming a live pid (pid 1) that no process holds was reported as a live run; the
    flock decides now. A held one is described, its hostile text (escape codes, a list) made plain."""
    import socket
    import subprocess
    import sys

    out = copy_out(made, tmp_path / "out")
    lock = out / "gemma4enc.lock"
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": "now"}))
    r = RUN.invoke(app, ["inspect", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["running"] is None, r.output
    lock.write_text("[1, 2]")  # not an object: no crash
    assert RUN.invoke(app, ["inspect", str(out), "--json"]).exit_code == 0
    lock.write_text(json.dumps({"pid": 1, "host": "h\x1b[2J\x07", "started": "x" * 1_000}))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\ntime.sleep(60)"), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said = json.loads(RUN.invoke(app, ["inspect", str(out), "--json"]).output)["running"]
        assert said.startswith("pid 1 on h\\x1b[2J\\x07, since xxx") and said.isprintable() and len(said) < 200, said
        r = encode([pics, "-o", out])
        assert r.exit_code == 2 and "in use by another gemma4enc run" in r.output and "\x1b" not in r.output
    finally:
        holder.kill()
        holder.wait()


def test_a_vllm_export_takes_the_umask_and_never_writes_through_a_link(made, tmp_path):
    """export --to vllm wrote every file 0600 whatever the umask, through guessable temp names; now
    its files take the umask (0644 under 022), and a key folder planted as a link out of DEST (a
    handed-over export, --overwrite) is refused, its target untouched."""
    import stat

    old = os.umask(0o022)
    try:
        dest = tmp_path / "vllm"
        assert RUN.invoke(app, ["export", str(made), str(dest), "--to", "vllm"]).exit_code == 0
        files = [p for p in dest.rglob("*") if p.is_file()]
        assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}
        key = next(p for p in dest.iterdir() if p.is_dir())
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        keep = decoy(elsewhere, "encoder_cache.safetensors")
        before = keep.read_bytes()
        import shutil

        shutil.rmtree(key)
        os.symlink(elsewhere, key)
        r = RUN.invoke(app, ["export", str(made), str(dest), "--to", "vllm", "--overwrite"])
        no_crash(r)
        assert r.exit_code == 2 and "symbolic link" in r.output, r.output
        assert keep.read_bytes() == before and sorted(p.name for p in elsewhere.iterdir()) == [keep.name]
    finally:
        os.umask(old)


def test_escape_codes_in_names_never_reach_a_terminal_and_pipes_get_the_real_name(pics, ckpt, tmp_path):
    """A file named with a terminal's escape codes (retitle the window, clear the screen): on a
    terminal search's hits and inspect's lines show them escaped, every message on stderr does, and
    through a pipe the hit is the exact path (it lost its `ESC[2J` before, as click strips ANSI)."""
    import pty
    import subprocess
    import sys

    media = tmp_path / "media"
    media.mkdir()
    (media / "p0.png").write_bytes((pics / "p0.png").read_bytes())
    evil = "x\x1b]0;PWNED\x07\x1b[2J.png"
    (media / evil).write_bytes((pics / "p0.png").read_bytes())
    (media / "bad\x1b[31m.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "gemma4enc"]
    r = subprocess.run([*cli, "encode", str(media), "-o", str(out), "--model", str(ckpt),
                        *flags(json=False, quiet=False)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "\x1b" not in r.stderr and "bad\\x1b[31m.png" in r.stderr, r.stderr
    piped = subprocess.run([*cli, "search", str(out), str(media / "p0.png"), "-k", "2"],
                           capture_output=True, text=True, timeout=300)
    assert f"{media}/{evil}" in piped.stdout.splitlines()[1], piped.stdout  # exact, for a script
    for args in (["search", str(out), str(media / "p0.png"), "-k", "2"], ["inspect", str(out)]):
        leader, follower = pty.openpty()
        p = subprocess.Popen([*cli, *args], stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        os.close(leader)
        assert p.wait(timeout=300) in (0, 1)
        text = seen.decode()
        assert "\x1b" not in text and "\x07" not in text, repr(text)
        assert "x\\x1b]0;PWNED\\x07\\x1b[2J.png" in text or "bad\\x1b[31m.png" in text, text


@pytest.mark.parametrize("planted", ["dev-zero-link", "fifo", "huge"])
def test_a_settings_json_that_never_ends_is_refused_not_read(made, pics, tmp_path, planted):
    """settings.json as a link to /dev/zero was read until memory ran out (MemoryError, exit 70),
    a FIFO would block the run for good, and 2 MiB of it was read whole: now it is opened as OUT's
    own files are (no link, regular files only) and read to 1 MiB at most; each command says so in
    one line (exit 2) or goes on without it."""
    import os

    out = copy_out(made, tmp_path / "out")
    settings = out / "settings.json"
    settings.unlink()
    if planted == "dev-zero-link":
        settings.symlink_to("/dev/zero")
    elif planted == "fifo":
        os.mkfifo(settings)
    else:
        settings.write_text('{"model": "' + "m" * (2 << 20) + '"}')
    for args in (["encode", str(pics), "-o", str(out), *BASE], ["inspect", str(out)], ["verify", str(out)]):
        r = RUN.invoke(app, args)
        no_crash(r)
        assert r.exit_code in (0, 1, 2), (args, r.output)
    r = RUN.invoke(app, ["encode", str(pics), "-o", str(out), *BASE])
    assert r.exit_code == 2 and "settings.json" in r.output, r.output


@pytest.mark.parametrize("bad", ['"x"', '{"sampling": 5, "model": "m"}', "[1]", "{broken", "null"])
def test_a_settings_json_of_the_wrong_shape_is_one_line(made, pics, tmp_path, bad):
    """settings.json as a string, a list, a number where an object goes, or broken JSON made encode
    and export --to vllm exit 70 (AttributeError): now every command says it in one line or goes
    on without it, never exit 70."""
    out = copy_out(made, tmp_path / "out")
    (out / "settings.json").write_text(bad)
    for args in (["encode", str(pics), "-o", str(out), *BASE], ["inspect", str(out)], ["verify", str(out)],
                 ["export", str(out), str(tmp_path / "v"), "--to", "vllm", "--overwrite"],
                 ["export", str(out), str(tmp_path / "p"), "--to", "parquet", "--overwrite"],
                 ["search", str(out), "--duplicates", "-q"], ["search", str(out), str(pics / "p0.png"), "-q"]):
        r = RUN.invoke(app, args)
        no_crash(r)
        assert r.exit_code in (0, 1, 2), (args, r.output)
