"""Re-runs over big folders that are mostly done: no-op, 1 % changed, inspect, verify (issue 16).

    python benchmarks/ledger.py --n 100000 --n 1000000 --json bench-out/ledger.json
    python benchmarks/ledger.py --n 1000000 --work-alone   # 1 % run beside its work done alone
    python benchmarks/ledger.py --startup            # one photo end to end, where the time goes

For each N it makes, under --work, N files as hard links to a few small photos (cheap) and an
output folder that already holds all of them: settings.json, shards and manifest.jsonl written
directly in their formats (one token per file, so shards stay small), as a finished
`gemma4enc encode` would leave them. Then it times the real CLI in fresh processes under
/usr/bin/time: a no-op re-run, a re-run after 1 % of the files were replaced (the work is done
by the tiny random checkpoint of `gemma4enc demo`, not a real tower), `inspect` and `verify`.
Wall, CPU (user + sys) and peak RSS of the largest process are reported side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

PER_DIR = 1000
PER_SHARD = 50_000
SOURCES = 4
LINKS = 60_000  # per source file: ext4 allows 65,000 hard links to one inode
CLI = [sys.executable, "-m", "gemma4enc"]
PROFILE: Path | None = None  # --profile: the 1 % run and the work alone under cProfile, one .prof each


def profiled(name: str) -> list[str]:
    """The CLI, under cProfile (main process only: decode workers are not profiled) with --profile."""
    if PROFILE is None:
        return CLI
    return [sys.executable, "-m", "cProfile", "-o", str(PROFILE / f"{name}.prof"), "-m", "gemma4enc"]
# 70 soft tokens per image: the smallest budget keeps the tiny tower's share of the 1 % run small
FLAGS = ["--device", "cpu", "--dtype", "float32", "--out-dtype", "float32", "--max-soft-tokens", "70", "--json", "-q"]


def checkpoint(work: Path) -> Path:
    from gemma4enc.dev import demo

    folder = work / "ckpt"
    if not (folder / "config.json").exists():
        demo.build(folder, seed=1, clipped=True, standardize=False)
    return folder


def sources(work: Path, n: int = 1) -> list[Path]:
    """SOURCES photos, copied as often as N links need (each copy its own inode)."""
    from gemma4enc.dev.demo import write_images

    folder = work / "sources"
    if not folder.exists():
        write_images(folder)
    photos = sorted(p for p in folder.iterdir() if p.is_file())[:SOURCES]
    copies = [photos]
    for k in range(1, -(-n // (LINKS * SOURCES))):
        (folder / f"copy{k}").mkdir(exist_ok=True)
        copies.append([Path(shutil.copy(p, folder / f"copy{k}" / p.name)) for p in photos])
    return [p for c in copies for p in c]


def make_folder(work: Path, n: int, ckpt: Path) -> tuple[Path, Path]:
    """N hard links and an output folder whose manifest already has a row for each.

    Streamed: each shard and its manifest rows are written as its links are made, so memory does
    not grow with N (a list of 10 M paths and stat results would take several GB).
    """
    # absolute, as encode records them: rows of a relative --work would match no file
    media, out = (work / f"media-{n}").resolve(), (work / f"out-{n}").resolve()
    shutil.rmtree(media, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    srcs = [(p, p.stat()) for p in sources(work, n)]
    with Output(out, ckpt) as output:
        for lo in range(0, n, PER_SHARD):
            chunk = []
            for i in range(lo, min(lo + PER_SHARD, n)):
                folder = media / f"d{i // PER_DIR:05d}"
                if i % PER_DIR == 0:
                    folder.mkdir(parents=True)
                src, st = srcs[i % len(srcs)]
                path = folder / f"p{i:07d}{src.suffix}"
                os.link(src, path)
                chunk.append((str(path), st))
            output.shard(lo // PER_SHARD, chunk)
    return media, out


class Output:
    """A finished output folder written shard by shard: settings.json, shards, manifest.jsonl."""

    def __init__(self, out: Path, ckpt: Path):
        from gemma4enc.options import Options
        from gemma4enc.output.files import MANIFEST
        from gemma4enc.output.settings import settings_of

        out.mkdir(parents=True)
        # what a run with FLAGS records: the model's resolved path, the dtype it ran in, no hub revision
        options = Options(model=str(Path(ckpt).resolve()), dtype="float32", out_dtype="float32", image_tokens=70)
        (out / "settings.json").write_text(json.dumps(settings_of(options, {"revision": None}), indent=2))
        self.out, self.manifest = out, open(out / MANIFEST, "wb")
        self.width = json.loads((ckpt / "config.json").read_text())["text_config"]["hidden_size"]

    def shard(self, number: int, chunk: list) -> None:
        import torch
        from safetensors.torch import save_file

        from gemma4enc.output.files import line_of

        name = f"shard-{number:06d}.safetensors"
        meta = {"format_version": "1", "out_dtype": "float32", "hidden_size": str(self.width)}
        k = torch.arange(len(chunk) + 1)
        save_file({"tokens": torch.zeros(len(chunk), self.width), "item_offsets": k, "frame_offsets": k.clone(),
                   "item_frames": k.clone(), "pooled": torch.zeros(len(chunk), self.width)},
                  str(self.out / name), metadata=meta)
        self.manifest.write(b"".join(line_of({
            "path": p, "kind": "image", "size": st.st_size, "mtime_ns": st.st_mtime_ns, "status": "ok",
            "error": None, "shard": name, "index": j, "tokens": 1, "frames": 1, "frame_tokens": [1],
            "width": 64, "height": 48}) for j, (p, st) in enumerate(chunk)))

    def __enter__(self) -> "Output":
        return self

    def __exit__(self, *exc) -> None:
        self.manifest.close()


def change(media: Path, share: float) -> list[Path]:
    """Replace every (1/share)-th file by a new photo of its own: new size, new mtime."""
    from PIL import Image

    step, changed = round(1 / share), []
    for i, path in enumerate(sorted(p for d in sorted(media.iterdir()) for p in d.iterdir())):
        if i % step == 0:
            path.unlink()
            Image.new("RGB", (40 + i % 50, 30), (i % 256, (i // 256) % 256, 90)).save(path, format="JPEG")
            changed.append(path)
    return changed


def alone(work: Path, media: Path, changed: list[Path], ckpt: Path) -> dict:
    """The 1 % run's work by itself: a fresh encode of a folder holding only the changed files."""
    folder, out = work / f"alone-{len(changed)}", work / f"alone-out-{len(changed)}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    for path in changed:  # hard links: the same bytes, sizes and mtimes, under the same relative paths
        (folder / path.parent.relative_to(media)).mkdir(parents=True, exist_ok=True)
        os.link(path, folder / path.relative_to(media))
    result = timed([*profiled("work_alone"), "encode", str(folder), "-o", str(out), "--model", str(ckpt), *FLAGS])
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return result


def timed(args: list[str]) -> dict:
    """Wall, user+sys CPU and peak RSS (largest process) of one CLI call, with its JSON summary."""
    load = os.getloadavg()[0]
    result = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True)
    stats = dict(re.findall(r"^\s*(.+?): (.+)$", result.stderr, re.M))
    m, s = stats["Elapsed (wall clock) time (h:mm:ss or m:ss)"].rsplit(":", 1)
    wall = float(s) + 60 * sum(float(x) * 60 ** k for k, x in enumerate(reversed(m.split(":"))))
    try:
        report = json.loads(result.stdout)
    except ValueError:
        report = {}
    return {"exit": result.returncode, "wall_s": round(wall, 2),
            "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # before, after: the machine is shared
            "cpu_s": round(float(stats["User time (seconds)"]) + float(stats["System time (seconds)"]), 2),
            "peak_rss_mb": round(int(stats["Maximum resident set size (kbytes)"]) / 1024, 1),
            "summary": {k: report[k] for k in ("files", "done_before", "encoded", "failed", "ok", "shards",
                                               "superseded_rows") if k in report},
            "log": [line for line in result.stderr.splitlines() if line.startswith("gemma4enc")][-3:]}


def bench_n(work: Path, n: int, ckpt: Path, log, changed: bool = True, work_alone: bool = False,
            keep: bool = False) -> dict:
    start = time.perf_counter()
    media, out = make_folder(work, n, ckpt)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the generator's own peak: streamed
    log(f"N={n}: folder and manifest made in {time.perf_counter() - start:.0f} s, this process's peak RSS {peak_mb:.0f} MB")
    encode = [*CLI, "encode", str(media), "-o", str(out), "--model", str(ckpt), *FLAGS]
    row = {"n": n, "manifest_mb": round((out / "manifest.jsonl").stat().st_size / 2**20, 1),
           "generator_peak_rss_mb": round(peak_mb)}
    row["no_op"] = timed(encode)
    log(f"N={n} no-op: {row['no_op']}")
    if changed:
        files = change(media, 0.01)
        row["changed_files"] = len(files)
        if work_alone:  # before the 1 % run, which leaves no file to do
            row["work_alone"] = alone(work, media, files, ckpt)
            log(f"N={n} the {len(files)} changed files alone, fresh output: {row['work_alone']}")
        row["changed_1pct"] = timed([*profiled("changed_1pct"), *encode[len(CLI):]])
        log(f"N={n} 1 % changed: {row['changed_1pct']}")
        if work_alone:  # the claim: the 1 % run costs the no-op plus the work
            row["no_op_plus_work_alone"] = {k: round(row["no_op"][k] + row["work_alone"][k], 2)
                                            for k in ("wall_s", "cpu_s")}
            log(f"N={n} no-op + work alone: {row['no_op_plus_work_alone']}")
    row["inspect"] = timed([*CLI, "inspect", str(out), "--json"])
    log(f"N={n} inspect: {row['inspect']}")
    row["verify"] = timed([*CLI, "verify", str(out), "--json"])
    log(f"N={n} verify: {row['verify']}")
    row["compact"] = timed([*CLI, "compact", str(out), "--json"])
    log(f"N={n} compact: {row['compact']}")
    if not keep:
        shutil.rmtree(media, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return row


STARTUP = r"""
import sys, time
t0 = time.perf_counter()
marks = {}
c0 = time.process_time()
def mark(name):  # (wall s, this process's CPU s) since start: the machine is shared, CPU says more
    marks.setdefault(name, (round(time.perf_counter() - t0, 3), round(time.process_time() - c0, 3)))
from gemma4enc.commands import cli
from gemma4enc.media import workers
from gemma4enc.run import encode as run
mark("cli imported")
def wrap(owner, name, before=None, after=None):
    real = getattr(owner, name)
    def wrapped(*a, **k):
        before and mark(before)
        result = real(*a, **k)
        after and mark(after)
        return result
    setattr(owner, name, wrapped)
wrap(workers.DecodePool, "start", before="workers: start asked")
wrap(workers.DecodePool, "_start_all", after="workers: all started")
real_engine = run._engine
def engine(name):
    mark("engine: chosen")
    encode = real_engine(name)
    from gemma4enc.model import load as local
    real_open = local.open_tower
    def open_tower(*a, **k):
        mark("model: load begins")
        opened = real_open(*a, **k)
        mark("model: loaded")
        wrap(type(opened[0]), "encode", before="tower: first call", after="tower: first call done")
        return opened
    local.open_tower = open_tower
    return encode
run._engine = engine
wrap(workers.DecodePool, "take_workers", after="pipeline: workers taken over")
try:
    cli.app(sys.argv[1:])
except SystemExit:
    pass
mark("exit")
print(marks)
"""


def startup(work: Path, log) -> dict:
    """One photo, fresh output: the whole process (time -v) and the moments inside it."""
    ckpt = checkpoint(work)
    photo = work / "one"
    shutil.rmtree(photo, ignore_errors=True)
    photo.mkdir()
    shutil.copy(sources(work)[0], photo)
    args = [str(photo), "--model", str(ckpt), *FLAGS]
    shutil.rmtree(work / "one-out", ignore_errors=True)
    whole = timed([*CLI, "encode", *args, "-o", str(work / "one-out")])
    shutil.rmtree(work / "one-out", ignore_errors=True)
    inside = subprocess.run([sys.executable, "-c", STARTUP, "encode", *args, "-o", str(work / "one-out")],
                            capture_output=True, text=True)
    marks = eval(inside.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's dict
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch, transformers"],
                             capture_output=True, text=True).stderr.strip().splitlines()[-3:]
    report = {"whole_process": whole, "moments_s": marks, "import_torch_transformers_tail": imports}
    if "tower: first call" in marks and "model: loaded" in marks:  # the target: ~2 s past the model's load
        report["first_tower_call_after_model_loaded_s"] = round(marks["tower: first call"][0] - marks["model: loaded"][0], 2)
    log(json.dumps(report, indent=2))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, action="append", help="files (repeatable); default 100000 and 1000000")
    ap.add_argument("--work", type=Path, default=Path("bench-out/ledger"))
    ap.add_argument("--changed-up-to", type=int, default=10**9, help="the 1 %% re-run only for N up to this")
    ap.add_argument("--work-alone", action="store_true",
                    help="with the 1 %% re-run, also a fresh encode of only the changed files, to compare")
    ap.add_argument("--profile", type=Path, help="write cProfile files of the 1 %% run and the work alone here")
    ap.add_argument("--keep", action="store_true", help="keep the folders (they are big at large N)")
    ap.add_argument("--startup", action="store_true", help="only the one-photo start-up breakdown")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    global PROFILE
    PROFILE = a.profile and a.profile.resolve()
    if PROFILE:
        PROFILE.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if a.startup:
        report = startup(a.work, log)
    else:
        ckpt = checkpoint(a.work)
        report = {"rows": [bench_n(a.work, n, ckpt, log, n <= a.changed_up_to, a.work_alone, a.keep)
                          for n in a.n or [100_000, 1_000_000]]}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
