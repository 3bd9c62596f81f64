"""What a new user ran into (issue 34, items 11 and 12): the line they read must say what is true
and what to do, in the user's own figures and words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from gemma4enc.commands.cli import app
from gemma4enc.media.frames import DecodeError
from gemma4enc.media.image import decode_image

from .helpers import BASE, RUN, encode


def test_the_bomb_limit_is_quoted_as_given(tmp_path):
    """Pillow's own error quotes twice its limit (its error threshold): the row says the user's."""
    Image.new("L", (400, 300)).save(tmp_path / "big.png")
    for limit in (100 * 100, 400 * 300 // 2 - 1):  # past Pillow's error threshold, and between the two
        with pytest.raises(DecodeError) as e:
            decode_image(str(tmp_path / "big.png"), limit)
        assert e.value.status == "too_large"
        assert str(e.value) == (f"400×300 = 120,000 pixels, more than --max-image-pixels {limit:,} (a "
                                "decompression bomb?); raise --max-image-pixels to allow it")
    assert decode_image(str(tmp_path / "big.png"), 400 * 300).info["width"] == 400  # at the limit: fine
    assert decode_image(str(tmp_path / "big.png"), None).info["width"] == 400  # 0 on the command line
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # Pillow's own setting is left as it was


def test_a_negative_pixel_limit_says_0_is_allowed(tmp_path):
    result = encode([tmp_path, "-o", tmp_path / "o", "--max-image-pixels", "-5", *BASE])
    assert result.exit_code == 2
    assert "--max-image-pixels -5: must be 0 (no limit) or more" in result.output


def test_a_nul_list_without_nul_warns(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path}/a.jpg\n{tmp_path}/b.jpg\n")
    result = RUN.invoke(app, ["plan", "--files-from", str(listing), "-0", "--json"])
    assert (f"gemma4enc: warning: --files-from {listing} with -0 holds no NUL byte but several lines: "
            "read as ONE name; leave out -0 for one path a line") in result.stderr
    listing.write_bytes(f"{tmp_path}/a.jpg\0{tmp_path}/b.jpg\0".encode())
    assert "warning" not in RUN.invoke(app, ["plan", "--files-from", str(listing), "-0", "--json"]).stderr


def test_encode_dash_hints_at_files_from_stdin(tmp_path, ckpt):
    result = encode(["-", "-o", tmp_path / "o", "--model", ckpt, *BASE])
    assert result.exit_code == 2
    assert "-: no such file or folder (to read the paths from stdin: --files-from -)" in result.output


def test_an_out_that_is_no_folder_says_so(tmp_path, ckpt):
    media = tmp_path / "m"
    media.mkdir()
    Image.new("RGB", (32, 32)).save(media / "a.png")
    file = tmp_path / "file"
    file.write_text("mine")
    for out, kind in (("/dev/null", "not a folder"), (str(file), "a file")):
        result = encode([media, "-o", out, "--model", ckpt, *BASE])
        assert result.exit_code == 2, result.output
        assert (f"-o {out}: {kind}; OUT is the folder the shards and manifest go in (new, or one encode "
                "made)") in result.output
        assert "File exists" not in result.output
    assert file.read_text() == "mine"


def test_verify_quiet_prints_only_problems(tmp_path, ckpt):
    media = tmp_path / "m"
    media.mkdir()
    Image.new("RGB", (32, 32)).save(media / "a.png")
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    quiet = RUN.invoke(app, ["verify", str(out), "-q"])
    assert quiet.exit_code == 0 and quiet.stdout == ""
    next(out.glob("*.safetensors")).unlink()
    quiet = RUN.invoke(app, ["verify", str(out), "--quiet"])
    assert quiet.exit_code == 1
    assert quiet.stdout and all(line.startswith("problem: ") for line in quiet.stdout.splitlines())


def test_help_names_arguments_as_a_user_types_them_and_lists_every_exit_code():
    for command, usage in (("verify", "verify [OPTIONS] OUT\n"), ("encode", "encode [OPTIONS] [ROOTS]...\n"),
                           ("search", "search [OPTIONS] OUT [FILES]...\n"), ("export", "export [OPTIONS] OUT DEST\n")):
        text = RUN.invoke(app, [command, "--help"]).stdout
        assert usage in text, text
        assert "{" not in text.split("\n\n")[0] and "<list[" not in text and "<str>" not in text.split("Options:")[0]
        assert "70 a bug" in " ".join(text.split()), text


def test_worker_advice_leaves_out_files_that_timed_out_or_were_missing():
    """One 60 s timeout among fast photos made "about 375 workers would feed it"."""
    from gemma4enc.rows import Status
    from gemma4enc.run.pipeline import Summary, _timed, where_time_went

    class Late:  # decoded items as the pool yields them: the timed-out one after a long wait
        def __init__(self, status, wait):
            self.status, self.wait = status, wait

    import time

    def decoded():
        for d in (Late(Status.OK, 0.0), Late(Status.TIMEOUT, 0.3), Late(Status.NOT_FOUND, 0.0), Late(Status.OK, 0.0)):
            time.sleep(d.wait)
            yield d

    summary = Summary(files=4, by_status={"ok": 2, "timeout": 1, "not_found": 1})
    assert len(list(_timed(decoded(), summary))) == 4
    assert summary.stalled_wait >= 0.3 > summary.decode_wait
    summary.seconds = summary.stalled_wait + 0.2  # the towers' own time
    facts, advice = where_time_went(summary, workers=2)
    assert advice is None and facts["tower_waited_share"] < 0.5
    # the same wait on decoding itself is advice, as before
    facts, advice = where_time_went(Summary(files=4, seconds=10.0, decode_wait=6.0, by_status={"ok": 4}), 2)
    assert advice == "decode-bound: the tower waited 60% of the time; about 5 workers would feed it (now 2)"



def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_folders_of_killed_runs_are_swept_and_no_other(tmp_path, monkeypatch, ckpt):
    """A kill -9 leaves gemma4enc-out-PID-… (a store OUT's mirror), g4e-ray-PID-… (a private Ray)
    and gemma4enc-task-PID-… (a Ray actor's task); the next run removes those whose process is
    gone, and nothing else: a live process's, a fresh one, one not ours by name."""
    import os
    import tempfile
    import time

    from gemma4enc.run import tempsweep

    temp = tmp_path / "tmp"
    temp.mkdir()
    dead, old = _dead_pid(), time.time() - 600
    names = {f"gemma4enc-out-{dead}-a1": False, f"g4e-ray-{dead}-b2": False, f"gemma4enc-task-{dead}-c3": False,
             f"gemma4enc-out-{os.getppid()}-d4": True,  # a live process's
             f"g4e-ray-{dead}-fresh": True,  # not settled yet
             f"someone-else-{dead}-e5": True, "gemma4enc-out-x": True,
             f"gemma4enc-task-{dead}-notes": True}  # a user's folder named alike: no mark inside
    from gemma4enc.output.files import TEMP_MARK

    for name in names:
        (temp / name / "sub").mkdir(parents=True)
        (temp / name / "sub" / "f").write_text("x")
        if not name.endswith("notes"):
            (temp / name / TEMP_MARK).write_text("")
        if not name.endswith("fresh"):
            os.utime(temp / name, (old, old))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    media = tmp_path / "m"
    media.mkdir()
    Image.new("RGB", (32, 32)).save(media / "a.png")
    assert encode([media, "-o", tmp_path / "o", "--model", ckpt, *BASE]).exit_code == 0
    assert {n: (temp / n).exists() for n in names} == names
    assert tempsweep.sweep(str(temp)) == []  # nothing left to take


def test_failures_on_a_store_out_point_to_inspect(tmp_path, ckpt):
    """A store OUT's manifest is in parts (manifest.parts/…): the line points to `inspect`, which
    reads them, not to a manifest.jsonl that may be empty."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from .helpers import loopback_s3

    media = tmp_path / "m"
    media.mkdir()
    Image.new("RGB", (32, 32)).save(media / "a.png")
    (media / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    with loopback_s3("edges") as (fs, _):
        result = RUN.invoke(app, ["encode", str(media), "-o", "s3://edges/out", "--model", str(ckpt),
                                  "--device", "cpu", "--workers", "0"])
        assert result.exit_code == 1, result.output
        line = next(x for x in result.stderr.splitlines() if "file(s) failed" in x)
        assert line.endswith("1 file(s) failed: broken.jpg: decode_error (see gemma4enc inspect s3://edges/out)"), line
        shown = RUN.invoke(app, ["inspect", "s3://edges/out"])
        assert "decode_error" in shown.stdout, shown.stdout


def test_search_a_tar_uses_its_members_rows_and_keeps_encodes_log_to_itself(tmp_path, ckpt):
    """A tar already in OUT is looked up member by member, not encoded again; a file OUT lacks is
    encoded with one line said, none of encode's own (model loaded, worker advice, a temp path)."""
    import tarfile

    media = tmp_path / "m"
    media.mkdir()
    for i, size in enumerate([(40, 30), (24, 56)]):
        Image.new("RGB", size, (40 * i, 90, 200)).save(media / f"p{i}.png")
    tar = tmp_path / "shard-00000.tar"
    with tarfile.open(tar, "w") as t:
        for p in sorted(media.iterdir()):
            t.add(p, arcname=p.name)
    out = tmp_path / "out"
    assert encode([tar, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    found = RUN.invoke(app, ["search", str(out), str(tar), "--json", "-k", "2", "--device", "cpu"])
    assert found.exit_code == 0, found.output
    results = json.loads(found.stdout)["results"]
    assert {r["file"]: r["source"] for r in results} == {f"{tar}/p0.png": "out", f"{tar}/p1.png": "out"}
    assert all(r["hits"][0]["path"] == r["file"] for r in results)
    assert "encoding" not in found.stderr

    new = tmp_path / "new.png"
    Image.new("RGB", (33, 33), (9, 9, 9)).save(new)
    asked = RUN.invoke(app, ["search", str(out), str(new), "--json", "--device", "cpu"])
    assert asked.exit_code == 0, asked.output
    assert json.loads(asked.stdout)["results"][0]["source"] == "encoded"
    assert asked.stderr.splitlines() == [f"gemma4enc: encoding 1 file(s) {out} lacks, with its settings"]


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_seek_keyframe_that_folds_frames_records_what_was_asked(tmp_path, ckpt, backend):
    """One keyframe in the clip: --seek keyframe gives one frame for the 4 asked; the row says 4."""
    if backend == "decord":
        pytest.importorskip("decord")
    from gemma4enc.dev.demo import write_video

    from .helpers import shard_tokens

    media = tmp_path / "m"
    media.mkdir()
    write_video(media / "one_key.mp4", frames=40, gop=100)
    write_video(media / "many_keys.mp4", frames=40, gop=1)
    out = tmp_path / "out"
    result = encode([media, "-o", out, "--model", ckpt, *BASE, "--seek", "keyframe", "--video-backend", backend])
    assert result.exit_code == 0, result.output
    rows = {Path(r["path"]).name: r for r in shard_tokens(out)[0]}
    folded = rows["one_key.mp4"]
    assert len(folded["frame_indices"]) < 4 and folded["frames_asked"] == 4 and folded["frames"] < 4
    assert len(rows["many_keys.mp4"]["frame_indices"]) == 4 and "frames_asked" not in rows["many_keys.mp4"]


def _slow_decode(item, options):
    import time

    from gemma4enc.media.prepare import Decoded

    time.sleep(1.0)  # the run is killed meanwhile
    return Decoded(item)


def test_a_decode_worker_whose_run_is_gone_ends_quietly(capfd):
    """After kill -9 of the run, a worker that finishes its file finds the pipe broken: it ends,
    without a BrokenPipeError traceback on the terminal the run left."""
    import multiprocessing as mp

    from gemma4enc.media.kinds import Item
    from gemma4enc.media.workers import _serve
    from gemma4enc.options import Options

    ctx = mp.get_context("fork")  # the pipe's ends, as the run and its worker hold them
    run_end, worker_end = ctx.Pipe()

    def serve():  # the worker holds its own end only, as a forkserver's child does
        run_end.close()
        _serve(worker_end, _slow_decode, Options())

    worker = ctx.Process(target=serve, daemon=True)
    worker.start()
    try:
        worker_end.close()
        run_end.send((0, Item("/x.jpg", "image", 1, 1), 1))
        run_end.close()  # the run dies while the worker decodes
        worker.join(60)
        assert worker.exitcode == 0
        assert "Traceback" not in capfd.readouterr().err
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


def test_plan_counts_a_webms_frames_from_its_header(tmp_path, ckpt):
    """WebM states no frame count: its duration and rate give it, as encode then finds (10, not 32)."""
    from gemma4enc.dev.demo import write_video

    media = tmp_path / "m"
    media.mkdir()
    write_video(media / "short.webm", frames=10, codec="libvpx-vp9")
    plan = json.loads(RUN.invoke(app, ["plan", str(media), "--json", "--frames", "32"]).stdout)
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *BASE, "--frames", "32"]).exit_code == 0
    from .helpers import shard_tokens

    row = shard_tokens(out)[0][0]
    assert row["frames"] == 10 and plan["tower_items"] == 10, (row["frames"], plan)
