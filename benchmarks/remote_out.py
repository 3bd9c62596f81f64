"""What an s3:// OUT costs against a local one: the same files encoded into a new local folder and a
new prefix of a loopback S3 (moto's server, the store the tests use), alternated, then re-run.

    python benchmarks/remote_out.py --files 400 --rounds 2 --json bench-out/remote_out.json

A loopback moto has no network and no throttling: what this measures is the tool's own overhead for
a store (the mirror, the uploads, one part per shard, the lock, the listing at the start), not a
real store's latency. Reported per run: wall seconds, and for the store the objects it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import CLI, FLAGS, checkpoint, sources  # noqa: E402


def media(work: Path, n: int) -> Path:
    folder = work / f"photos-{n}"
    if not folder.exists():
        folder.mkdir(parents=True)
        srcs = sources(work, 1)
        for i in range(n):
            src = srcs[i % len(srcs)]
            os.link(src, folder / f"p{i:05d}{src.suffix}")
    return folder


def run(args: list[str], env: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shard-size", default="256KB", help="small shards: many uploads and parts")
    p.add_argument("--work", type=Path, default=Path("bench-work"))
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's log line per request

    a.work.mkdir(parents=True, exist_ok=True)
    folder, ckpt = media(a.work, a.files), checkpoint(a.work)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.update(env)
    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    flags = ["--model", str(ckpt), *FLAGS, "--workers", "1", "--shard-size", a.shard_size]
    results = []
    for r in range(a.rounds):
        for where in ("local", "s3"):
            out = str(a.work / f"out-{r}") if where == "local" else f"s3://bench/out-{r}"
            first, report = run(["encode", str(folder), "-o", out, *flags], env)
            again, noop = run(["encode", str(folder), "-o", out, *flags], env)
            row = {"round": r, "out": where, "first_s": round(first, 2), "rerun_s": round(again, 2),
                   "encoded": report["encoded"], "rerun_encoded": noop["encoded"]}
            if where == "s3":
                fs.invalidate_cache()
                names = [n.rsplit("/", 1)[-1] for n in fs.find(f"bench/out-{r}")]
                row |= {"shards": sum(n.startswith("shard-") for n in names),
                        "parts": sum(n.endswith(".jsonl") and n != "manifest.jsonl" for n in names)}
            results.append(row)
            print(json.dumps(row), flush=True)
    server.stop()
    summary = {"files": a.files, "shard_size": a.shard_size, "cpu": _cpu(), "load_1min": os.getloadavg()[0],
               "runs": results}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(summary, indent=2))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
