"""Every way out of the CLI is its documented exit code and one line, through the real CLI:
bad flags before anything heavy is imported, a full disk and a read-only OUT on real mounts,
an interrupt, a bug; --json prints an object on every exit."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemma4enc.commands.cli import app

from .helpers import BASE, RUN, encode_in_subprocess, shard_tokens


def test_bad_flags_exit_2_with_one_line_before_torch_is_imported(good, tmp_path):
    """Checked in one process: none of these may import torch or transformers, or load a model."""
    (tmp_path / "list.txt").write_text(str(good / "photo0.jpg"))
    cases = [["--batching", "fast"], ["--shard-size", "1.2.3"], ["--shard-size", "."], ["--shard-size", "0"],
             ["--max-batch-patches", "0"], ["--max-soft-tokens", "100"], ["--files-from", str(tmp_path / "missing.txt")],
             ["--device", "gpu"], ["--engine", "spark"], ["--ray-actors", "2"]]
    runs = [[str(good), "-o", str(tmp_path / "out"), *c, "--json"] for c in cases]
    runs.append([str(tmp_path / "medai"), "-o", str(tmp_path / "out"), "--json"])  # a mistyped root
    code = f"""
import contextlib, io, json, sys
from gemma4enc.commands.cli import main
results = []
for args in {runs!r}:
    sys.argv = ["gemma4enc", "encode", *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            results.append([e.code, out.getvalue(), err.getvalue()])
heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
print(json.dumps({{"results": results, "heavy": heavy}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["heavy"] == []
    assert len(report["results"]) == len(runs)
    for args, (exit_code, stdout, stderr) in zip(runs, report["results"]):
        assert exit_code == 2, (args, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("gemma4enc: error: "), (args, stderr)
        assert json.loads(stdout) == {"error": lines[0].removeprefix("gemma4enc: error: "), "exit_code": 2}
    assert not (tmp_path / "out").exists()  # nothing was written


def test_an_interrupt_and_a_bug_get_their_codes_and_json(good, ckpt, tmp_path, monkeypatch):
    import gemma4enc.run.encode

    args = ["encode", str(good), "-o", str(tmp_path / "out"), "--model", str(ckpt), "--json", "-q"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    def buggy(*a, **k):
        raise RuntimeError("something nobody foresaw\nsecond line")

    monkeypatch.setattr(gemma4enc.run.encode, "encode_files", interrupted)
    result = RUN.invoke(app, args)
    assert result.exit_code == 130 and "re-run to resume" in result.output
    assert json.loads(result.stdout)["exit_code"] == 130
    monkeypatch.setattr(gemma4enc.run.encode, "encode_files", buggy)
    for debug in ("", "1"):
        monkeypatch.setenv("GEMMA4ENC_DEBUG", debug)
        result = RUN.invoke(app, args)
        assert result.exit_code == 70 and isinstance(result.exception, SystemExit)
        assert "internal error: RuntimeError: something nobody foresaw (a bug; GEMMA4ENC_DEBUG=1" in result.output
        assert ("Traceback" in result.output) == (debug == "1") and "second line" not in result.stdout
        assert json.loads(result.stdout)["exit_code"] == 70


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real small filesystem at `where` (root only); the test is skipped where mounting is refused."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {e}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@pytest.mark.slow
def test_disk_full_mid_run_exits_4_with_one_line_and_a_rerun_resumes(good, ckpt, tmp_path):
    """A real full filesystem: safetensors' own error (no strerror) and the manifest's OSError alike."""
    clean = tmp_path / "clean"
    args = ["--model", ckpt, *BASE, "--shard-size", "1", "--flush-seconds", "0.1"]
    assert encode_in_subprocess(good, "-o", clean, *args).returncode == 0
    written = sum(p.stat().st_size for p in clean.iterdir())
    with tmpfs(tmp_path / "disk", "4m") as disk:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / "filler"  # ours, not OUT's: leaves room for about half the output
        filler.write_bytes(b"\0" * (free - written // 2))
        out = disk / "out"
        full = encode_in_subprocess(good, "-o", out, *args, "-q")  # -q: no progress lines on a slow machine, only the error
        assert full.returncode == 4, full.stderr
        lines = full.stderr.splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0] and "re-run to resume" in lines[0], lines
        assert json.loads(full.stdout) == {"error": lines[0].removeprefix("gemma4enc: error: "), "exit_code": 4}
        assert 0 < len((out / "manifest.jsonl").read_text().splitlines()) < 6  # some files landed, not all
        filler.unlink()
        again = encode_in_subprocess(good, "-o", out, *args)
        assert again.returncode == 0, again.stderr
        a, b = shard_tokens(clean)[1], shard_tokens(out)[1]
        assert {Path(p).name for p in a} == {Path(p).name for p in b}
        by_name = {Path(p).name: t for p, t in b.items()}
        assert all(torch.equal(t, by_name[Path(p).name]) for p, t in a.items())


def test_disk_full_before_any_file_is_saved_says_none_was(good, ckpt, tmp_path):
    """Room for OUT's small files, none for a shard: the line does not claim files were saved."""
    clean = tmp_path / "clean"
    args = ["--model", ckpt, *BASE, "--shard-size", "1", "--flush-seconds", "0.1"]
    assert encode_in_subprocess(good, "-o", clean, *args).returncode == 0
    smallest = min(p.stat().st_size for p in clean.glob("*.safetensors"))
    with tmpfs(tmp_path / "disk", "4m") as disk:
        (disk / "out").mkdir()
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        room = 16 << 10  # the settings, the lock, the empty manifest: pages, not a shard
        if smallest < 2 * room:
            pytest.skip(f"the smallest shard ({smallest} bytes) would fit in the room left")
        (disk / "filler").write_bytes(b"\0" * (free - room))
        full = encode_in_subprocess(good, "-o", disk / "out", *args, "-q")
        assert full.returncode == 4, full.stderr
        lines = full.stderr.splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0], lines
        assert "no file of this run was saved (what earlier runs saved stays); re-run once it is writable" in lines[0]
        assert "the files finished before are saved" not in lines[0]
        manifest = disk / "out" / "manifest.jsonl"
        assert not manifest.exists() or not manifest.read_text().strip()


def test_a_read_only_out_is_a_usage_error(good, ckpt, tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as ro:
        (ro / "out").mkdir()
        remount = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True, timeout=30)
        if remount.returncode:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        result = encode_in_subprocess(good, "-o", ro / "out", "--model", ckpt, *BASE)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [f"gemma4enc: error: cannot write to {ro / 'out'}: Read-only file system"]
        assert json.loads(result.stdout)["exit_code"] == 2


def test_search_on_a_read_only_out_says_the_index_is_not_cached_in_one_line(good, ckpt, tmp_path):
    """faiss cannot cache its index in a read-only OUT: one line in the user's words, no C++ text."""
    pytest.importorskip("faiss")
    with tmpfs(tmp_path / "ro", "8m") as ro:
        out = ro / "out"
        assert encode_in_subprocess(good, "-o", out, "--model", ckpt, *BASE).returncode == 0
        remount = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True, timeout=30)
        if remount.returncode:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        run = subprocess.run([sys.executable, "-m", "gemma4enc", "search", str(out), str(good / "photo0.jpg"), "-k", "2"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        said = [line for line in run.stderr.splitlines() if "not cached" in line]
        assert said == [f"gemma4enc: the search index is not cached in {out} (Read-only file system); "
                        "it is built again next time"], run.stderr
        assert "Traceback" not in run.stderr and "faiss" not in run.stderr
        assert run.stdout.splitlines()[0].endswith(str(good / "photo0.jpg"))


def test_safetensors_errors_read_as_the_os_error_they_wrap(tmp_path):
    """safetensors raises SafetensorError, which has no strerror: a real one from a full tmpfs."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from gemma4enc.errors import reason

    with tmpfs(tmp_path / "tiny", "64k") as tiny, pytest.raises(SafetensorError) as e:
        save_file({"t": torch.zeros(1 << 18)}, str(tiny / "x.safetensors"))
    assert not hasattr(e.value, "strerror") and reason(e.value) == "No space left on device"


def test_compact_on_a_read_only_out_is_one_line_and_exit_2(tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as ro:
        row = {"path": "/m/x.jpg", "kind": "image", "size": 1, "mtime_ns": 1, "status": "decode_error", "error": "e",
               "shard": None, "index": None, "tokens": 0, "frames": 0}
        (ro / "manifest.jsonl").write_text(json.dumps(row) + "\n")
        remount = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True, timeout=30)
        if remount.returncode:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        result = subprocess.run([sys.executable, "-m", "gemma4enc", "compact", str(ro), "--json"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [f"gemma4enc: error: cannot write to {ro}: Read-only file system"]
        assert json.loads(result.stdout) == {"error": f"cannot write to {ro}: Read-only file system", "exit_code": 2}


def test_a_report_or_log_on_a_full_device_is_one_line_not_a_traceback(good, ckpt, tmp_path):
    """/dev/full: every write fails with ENOSPC, as stdout or a log file on a full disk would."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "out"
    logged = encode_in_subprocess(good, "-o", out, "--model", ckpt, *BASE, "--log-file", "/dev/full", "-q")
    assert logged.returncode == 0, logged.stderr  # the tokens matter more than the log: the run goes on
    assert logged.stderr.splitlines() == [
        "gemma4enc: warning: --log-file /dev/full: No space left on device; it gets no more lines"]
    for args in (["inspect", str(out), "--json"], ["inspect", str(out)], ["compact", str(out), "--json"]):
        with open("/dev/full", "w") as full:
            result = subprocess.run([sys.executable, "-m", "gemma4enc", *args], stdout=full, stderr=subprocess.PIPE,
                                    text=True, timeout=120)
        assert result.returncode == 4, result.stderr
        assert result.stderr.splitlines() == ["gemma4enc: error: cannot write to stdout: No space left on device"]
    unopenable = encode_in_subprocess(good, "-o", out, "--log-file", str(tmp_path), "--json")
    assert unopenable.returncode == 2 and unopenable.stderr.splitlines() == [
        f"gemma4enc: error: --log-file {tmp_path}: Is a directory"], unopenable.stderr


def test_sighup_is_an_interrupt_with_its_line_and_json(ckpt, tmp_path):
    """A closed terminal or ssh session: saved, exit 130, the interrupted line and JSON, as SIGTERM."""
    import shutil
    import signal
    import time

    from .helpers import encode_argv, flags, photo

    media = tmp_path / "media"
    media.mkdir()
    photo(1200, 1600).save(media / "p00.png")
    for i in range(1, 30):  # long enough to be stopped half way
        shutil.copy(media / "p00.png", media / f"p{i:02d}.png")
    out = tmp_path / "out"
    proc = subprocess.Popen(encode_argv(media, "--model", ckpt, *flags(shard_size=1, workers=1), "-o", out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "manifest.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "gemma4enc: interrupted: finished files are saved, re-run to resume" in stderr, (
        proc.returncode, stderr)
    assert json.loads(stdout)["exit_code"] == 130


def test_a_url_where_only_a_local_path_will_do_is_refused_in_one_line(good, tmp_path, monkeypatch):
    """demo's and bench's folders, bench --json, --log-file: written here only. A URL is refused
    (exit 2, one line naming it), never made a local folder `s3:` (a Path folds s3://b into s3:/b).
    OUT, ROOTS, export's DIR, plan -o and --files-from take URLs (tests/test_remote_out.py)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.jsonl").write_text("")
    cases = [
        (["demo", "s3://bucket/demo"], "demo's FOLDER"),
        (["bench", "s3://bucket/media", "--e2e"], "bench's FOLDER"),
        (["bench", "--json", "s3://bucket/report.json"], "--json"),
        (["encode", str(good), "-o", str(tmp_path / "o"), "--log-file", "s3://bucket/log"], "--log-file"),
    ]
    for args, what in cases:
        result = RUN.invoke(app, args)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2, (args, result.output)
        url = next(a for a in args if "://" in a)
        assert lines == [f"gemma4enc: error: {url}: {what} must be a local path, not a URL"], (args, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], list(tmp_path.iterdir())  # no s3:, no o
