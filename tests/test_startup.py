"""What a run costs before its first file and after its last, guarded without a clock (issue 39;
the seconds are in docs/benchmarks.md, measured by benchmarks/fixed_cost.py): nothing heavy
imported where it is not needed, decoding begun before torch is imported, and the console
script's quick way out keeping the exit code, the output and the exit handlers."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from gemma4enc.media.workers import DecodePool
from gemma4enc.options import Options

from .helpers import BASE, photo
from .test_workers import fake_decode, items

HEAVY = ("torch", "transformers", "ray", "pyarrow", "safetensors", "av", "boto3", "fsspec")


def child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_help_and_a_bad_flag_import_nothing_heavy():
    """--help of the app and of encode, --version and a usage error: no torch, Ray, pyarrow …"""
    code = f"""
import contextlib, io, json, sys
from gemma4enc.commands.cli import main
codes = []
for argv in (["--help"], ["encode", "--help"], ["--version"], ["encode", "/nonexistent-gemma4enc", "--batching", "x"]):
    sys.argv = ["gemma4enc", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main()
        except SystemExit as e:
            codes.append(e.code)
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    done = child(code)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == {"codes": [0, 0, 0, 2], "heavy": []}


def test_a_fresh_run_hands_its_files_to_the_workers_before_torch_is_imported(ckpt, tmp_path):
    """The decode pool starts, with the first files to decode, before preflight imports torch, and the
    engine goes on with those workers (none started again)."""
    media = tmp_path / "media"
    media.mkdir()
    for i in range(3):
        photo(60 + 10 * i, 50, seed=i).save(media / f"p{i}.jpg")
    code = f"""
import json, sys
from gemma4enc.media import workers
seen, made = [], []
real_start, real_init = workers.DecodePool.start, workers._Worker.__init__
def start(pool, head=()):
    head = list(head)
    seen.append({{"torch": "torch" in sys.modules, "head": [h.path for h in head]}})
    return real_start(pool, head=head)
def init(self, *a, **k):
    made.append(1)
    real_init(self, *a, **k)
workers.DecodePool.start, workers._Worker.__init__ = start, init
from gemma4enc.commands.cli import main
sys.argv = ["gemma4enc", "encode", {str(media)!r}, "-o", {str(tmp_path / "out")!r}, "--model", {str(ckpt)!r},
            "--workers", "2", *{BASE!r}]
try:
    main()
except SystemExit as e:
    code = e.code
print("REPORT " + json.dumps({{"code": code, "starts": seen, "workers_made": len(made)}}))
"""
    done = child(code)
    assert done.returncode == 0, done.stderr
    summary, _, report = done.stdout.rpartition("REPORT ")
    report = json.loads(report)
    assert report["code"] == 0 and json.loads(summary)["encoded"] == 3
    assert report["starts"] == [{"torch": False, "head": [str(media / f"p{i}.jpg") for i in range(3)]}]
    assert report["workers_made"] == 2  # the early ones went on decoding: none replaced, none started again


def test_decoding_begun_at_start_goes_on_in_map(tmp_path):
    """start(head) gives the workers the first files at once; map() over files that begin with them
    goes on with the same run and workers, in order."""
    todo = items(tmp_path, [f"ok-{i}" for i in range(12)])
    pool = DecodePool(Options(), workers=2, timeout=30, fn=fake_decode).start(head=todo[:5])
    try:
        deadline = time.monotonic() + 120  # worker start-up on a loaded machine; no speed is asserted
        while not os.path.exists(todo[0].path + ".started") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(todo[0].path + ".started"), "the workers were given nothing before map()"
        got = list(pool.map(todo))
    finally:
        pool.close()
    assert [d.width for d in got] == list(range(12)) and all(d.status == "ok" for d in got)
    assert len({d.height for d in got}) == 2  # the two workers start() made decoded all of them


def test_map_over_other_files_than_the_head_decodes_those(tmp_path):
    """A head that the files mapped do not begin with is dropped: the files asked for come back, in order."""
    todo = items(tmp_path, [f"ok-{i}" for i in range(8)])
    pool = DecodePool(Options(), workers=2, timeout=30, fn=fake_decode).start(head=todo[:4])
    try:
        got = list(pool.map(todo[2:]))
    finally:
        pool.close()
    assert [d.width for d in got] == list(range(2, 8)) and all(d.status == "ok" for d in got)
    assert not [p for p in multiprocessing.active_children() if p.name == "gemma4enc-decode"]


def test_a_head_never_mapped_leaves_no_worker(tmp_path):
    pool = DecodePool(Options(), workers=2, timeout=30, fn=fake_decode).start(head=items(tmp_path, ["ok-1", "ok-2"]))
    pool.close()
    assert not [p for p in multiprocessing.active_children() if p.name == "gemma4enc-decode"]


@pytest.mark.parametrize("entry", ["console", "main"])
def test_the_console_scripts_quick_exit_keeps_the_code_the_output_and_the_exit_handlers(ckpt, tmp_path, entry):
    """The console script ends a process that imported torch without tearing the interpreter down:
    the exit handlers still run, stdout (piped) and --log-file are complete, a failed file still
    exits 1, and what only a full teardown would run (an object's __del__ at exit) does not.
    `main`: a script pip wrote when main() was the entry point (an install not redone) does the same."""
    media = tmp_path / "media"
    media.mkdir()
    photo(64, 48, seed=1).save(media / "good.jpg")
    (media / "broken.jpg").write_bytes(b"\xff\xd8\xff" + b"not a jpeg" * 10)
    ran, torn, log = tmp_path / "atexit-ran", tmp_path / "torn-down", tmp_path / "run.log"
    script = tmp_path / "bin" / "gemma4enc"  # as pip names it; decode workers import it again, guarded
    script.parent.mkdir()
    script.write_text(f"""import atexit, sys
from gemma4enc.commands.cli import {entry}
class Teardown:
    def __del__(self, _open=open):  # bound now: a teardown has removed the builtins by then
        _open({str(torn)!r}, "w").write("yes")
if __name__ == "__main__":
    atexit.register(lambda: open({str(ran)!r}, "w").write("yes"))
    keep = Teardown()
    sys.exit({entry}())
""")
    argv = ["encode", media, "-o", tmp_path / "out", "--model", ckpt, "--log-file", log, *BASE]
    done = subprocess.run([sys.executable, str(script), *map(str, argv)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # one file failed
    report = json.loads(done.stdout)  # the whole JSON summary reached the pipe
    assert report["encoded"] == 1 and report["failed"] == 1
    assert ran.read_text() == "yes"
    assert not torn.exists()  # the interpreter was not torn down: the quick way out was taken
    assert "1 ok, 1 failed" in log.read_text()


def test_in_process_main_still_ends_in_system_exit():
    """main() (what tests and library callers run) never ends the process itself."""
    code = """
import sys, torch
from gemma4enc.commands.cli import main
sys.argv = ["gemma4enc", "--version"]
try:
    main()
except SystemExit as e:
    print("still here", e.code)
"""
    done = child(code)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "still here 0", done.stderr


def test_the_fixed_cost_benchmark_reads_its_figures_as_the_issue_does():
    """benchmarks/fixed_cost.py: marginal = wall(2N) - wall(N), fixed = wall(N) - marginal,
    ratio = wall(N) / marginal; the traced parts are the gaps between the moments, then the teardown."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fixed_cost.py"
    spec = importlib.util.spec_from_file_location("fixed_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one, n, two = {"wall_s": 3.8, "cpu_s": 4.0}, {"wall_s": 20.4, "cpu_s": 30.0}, {"wall_s": 35.6, "cpu_s": 58.0}
    fig = bench.figures(one, n, two, 14, {"wall_s": 30.4})
    assert fig["marginal_N_s"] == 15.2 and fig["fixed_s"] == 5.2 and fig["ratio"] == round(20.4 / 15.2, 3)
    assert fig["one_photo_fixed_s"] == round(3.8 - 15.2 / 14, 2)
    assert fig["cpu_marginal_N_s"] == 28.0 and fig["cpu_fixed_s"] == 2.0
    assert fig["transformers_over_gemma4enc_wall"] == round(30.4 / 20.4, 2)
    parts = bench.parts([("interpreter up", 0.1, 0.05), ("cli imported", 0.4, 0.3)], 1.0)
    assert parts == {"process start → interpreter up": 0.1, "interpreter up → cli imported": 0.3,
                     "cli imported → process gone": 0.6}
