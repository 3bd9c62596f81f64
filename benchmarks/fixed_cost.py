"""A run's fixed cost: whole processes over 1, N and 2N photos, fresh, interleaved (issue 39).

    python benchmarks/fixed_cost.py --photos 14 --rounds 2 --json bench-out/fixed_cost.json

The workload is benchmarks/photos_e2e.py's (made once under --work): a random Gemma 4 checkpoint with
E2B's vision width cut to --layers layers, float32, and --photos camera-like 1600×1200 JPEGs at 280
tokens. The 2N folder holds the same photos twice (hard links under new names), so every file is
encoded and the second N costs what N photos cost once the run is going. Per round, in an order
that alternates, each a fresh process with a fresh output folder:

- `one`: `gemma4enc encode` of the first photo alone;
- `N`, `2N`: `gemma4enc encode` of the N and the 2N folder;
- `transformers`: benchmarks/photos_e2e.py's plain loop over the N folder (with --baseline).

Reported, from each kind's fastest round and per round alike:

- marginal = wall(2N) - wall(N): what the N photos cost once the run is going;
- fixed = wall(N) - marginal: start-up, the first batch's wait, what is not overlapped, the end;
- ratio = wall(N) / marginal (the issue's figure; 1.0 would be no fixed cost at all);
- one photo's wall less one photo's share of the marginal;
- transformers / gemma4enc wall over the N folder (with --baseline);
- overlap, from `gemma4enc bench --e2e` on the N folder (with --overlap): end-to-end over the
  slower of decode-only and encode-only, 1.0 at best.

--trace also runs one photo and the N folder once more with timestamps inside the process (the
parts of docs/benchmarks.md: imports, the decode pool, preflight, the lock, the model load, the
first decoded file, the first tower call, the end of the pipeline, the end of the command, the
interpreter's teardown measured from outside). CPU time (user + sys of the process and its
workers) is given too: on a shared machine it is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from photos_e2e import BASELINE, BATCH, checkpoint, photos  # noqa: E402 - the same workload

# timestamps inside one `gemma4enc encode`, by wrapping the functions that mark each part; printed as
# the last line of stdout at the interpreter's exit (the first atexit handler registered runs last)
TRACE = r"""
import atexit, json, os, sys, time
T0 = float(os.environ["FIXED_COST_T0"])  # the parent's clock just before it started this process
marks = []
def mark(name):
    marks.append((name, round(time.time() - T0, 3), round(time.process_time(), 3)))
atexit.register(lambda: (mark("atexit: last handler"), sys.stdout.write("\nTRACE " + json.dumps(marks) + "\n"),
                         sys.stdout.flush()))
mark("interpreter up")
from gemma4enc.commands import cli
mark("cli imported")
import gemma4enc.media.workers as workers, gemma4enc.run.encode as run, gemma4enc.run.preflight as pre
import gemma4enc.output.lock as lock, gemma4enc.run.local as local
def wrap(owner, name, before=None, after=None, once=True):
    real, seen = getattr(owner, name), []
    def wrapped(*a, **k):
        if before and not (once and seen):
            mark(before)
        result = real(*a, **k)
        if after and not (once and seen):
            mark(after)
        seen.append(1)
        return result
    setattr(owner, name, wrapped)
wrap(workers.DecodePool, "start", before="pool: start asked")
wrap(workers.DecodePool, "_start_all", after="pool: workers up")
wrap(pre, "preflight", before="preflight: begins (imports torch)", after="preflight: done")
wrap(lock.Lock, "acquire", after="lock: held")
wrap(lock.Lock, "release", before="lock: release")
wrap(run, "_record_settings", after="settings: written")
wrap(run, "still_to_do", after="todo: decided")
def open_model(real=local._encode_with):
    def inner(pool, todo, r):
        mark("engine: begins")
        import gemma4enc.model.load as load, gemma4enc.run.pipeline as pipeline
        mark("engine: torch side imported")
        wrap(load, "open_tower", before="model: load begins", after="model: loaded")
        wrap(pipeline, "_timed", before="pipeline: begins")
        wrap(pipeline.Encoder, "_encode", before="tower: first call", after="tower: first call done")
        wrap(pipeline, "where_time_went", before="pipeline: done (last shard written)")
        real_map = pool.map
        def mapped(items):
            first = True
            for d in real_map(items):
                if first:
                    mark("pipeline: first file decoded")
                    first = False
                yield d
        pool.map = mapped
        summary = real(pool, todo, r)
        mark("engine: done")
        return summary
    return inner
local._encode_with = open_model()
if hasattr(cli, "console"):  # as the console script: its quick exit runs the exit handlers, then ends
    real_quick_exit = cli._quick_exit
    cli._quick_exit = lambda code: (mark("command: done"), real_quick_exit(code))
    cli.console()
try:  # a checkout from before console() (--compare)
    cli.main()
except SystemExit as e:
    mark("command: done")
    raise
"""

# what pip writes for the console script `gemma4enc` (run as a file: decode workers import it again
# as their main module, as they do the installed one), calling console() where the checkout has it
SCRIPT = """import sys
try:
    from gemma4enc.commands.cli import console as entry
except ImportError:  # a checkout from before console() (--compare)
    from gemma4enc.commands.cli import main as entry
if __name__ == "__main__":
    sys.exit(entry())
"""
ROOT = Path(__file__).resolve().parent.parent


def timed(args: list[str], env: dict) -> dict:
    """Wall, CPU (user + sys of the process and every child it reaped) of one fresh process."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    start = time.perf_counter()
    # run from the work folder: a checkout in the current folder would shadow PYTHONPATH's (--compare)
    proc = subprocess.run(args, capture_output=True, text=True, env=env | {"FIXED_COST_T0": repr(t0)},
                          cwd=env["FIXED_COST_WORK"])
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{args[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "stdout": proc.stdout}


def encode_args(folder: Path, ckpt: Path, out: Path) -> list[str]:
    return ["encode", str(folder), "-o", str(out), "--model", str(ckpt), "--device", "cpu",
            "--dtype", "float32", "--out-dtype", "float32", "--json", "-q"]


def ours(folder: Path, ckpt: Path, work: Path, env: dict, trace: bool = False) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    head = [sys.executable, "-c", TRACE] if trace else [sys.executable, str(work / "gemma4enc")]
    result = timed([*head, *encode_args(folder, ckpt, out)], env)
    stdout = result.pop("stdout")
    if trace:
        stdout, _, marks = stdout.rpartition("\nTRACE ")
        result["marks"] = json.loads(marks)
    summary = json.loads(stdout)
    result |= {"pipeline_s": summary["seconds"], "encoded": summary["encoded"],
               "tower_waited_share": summary.get("tower_waited_share")}
    if summary["encoded"] != summary["files"]:
        raise SystemExit(f"{folder}: {summary}")
    shutil.rmtree(out, ignore_errors=True)
    return result


def baseline(folder: Path, ckpt: Path, env: dict) -> dict:
    result = timed([sys.executable, "-c", BASELINE, str(ckpt), str(folder), str(BATCH)], env)
    return result | eval(result.pop("stdout").strip().splitlines()[-1])  # noqa: S307 - our own script's dict


def doubled(folder: Path, work: Path) -> Path:
    """The photos twice: hard links under new names (no copy; every one is a file to encode)."""
    twice = work / f"{folder.name}-twice"
    shutil.rmtree(twice, ignore_errors=True)
    twice.mkdir()
    for p in sorted(folder.iterdir()):
        os.link(p, twice / p.name)
        os.link(p, twice / f"{p.stem}-again{p.suffix}")
    return twice


def figures(one: dict, n: dict, two: dict, photos: int, tf: dict | None = None) -> dict:
    marginal = two["wall_s"] - n["wall_s"]
    fig = {"wall_1_s": one["wall_s"], "wall_N_s": n["wall_s"], "wall_2N_s": two["wall_s"],
           "marginal_N_s": round(marginal, 2), "fixed_s": round(n["wall_s"] - marginal, 2),
           "ratio": round(n["wall_s"] / marginal, 3) if marginal > 0 else None,
           "one_photo_fixed_s": round(one["wall_s"] - marginal / photos, 2),
           "cpu_marginal_N_s": round(two["cpu_s"] - n["cpu_s"], 2),
           "cpu_fixed_s": round(2 * n["cpu_s"] - two["cpu_s"], 2)}
    if tf:
        fig["transformers_over_gemma4enc_wall"] = round(tf["wall_s"] / n["wall_s"], 2)
    return fig


def parts(marks: list, wall: float) -> dict:
    """The traced moments as parts: seconds between consecutive marks, then the teardown."""
    out, last = {}, ("process start", 0.0)
    for name, at, _ in marks:
        out[f"{last[0]} → {name}"] = round(at - last[1], 3)
        last = (name, at)
    out[f"{last[0]} → process gone"] = round(wall - last[1], 3)
    return out


def overlap(folder: Path, env: dict) -> dict:
    """`gemma4enc bench --e2e` on the folder: decode-only, encode-only, end-to-end, interleaved."""
    with_json = Path(folder).parent / "e2e.json"
    subprocess.run([sys.executable, "-m", "gemma4enc", "bench", "--e2e", str(folder), "--device", "cpu",
                    "--layers", "2", "--json", str(with_json)], check=True, env=env, capture_output=True,
                   cwd=env["FIXED_COST_WORK"])
    report = json.loads(with_json.read_text())
    return {"overlap": round(report["overlap"], 3), "items_per_s": report["items_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=14)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("bench-out/photos-e2e"))
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="the transformers loop over the N folder too, in each round")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="gemma4enc bench --e2e on the N folder, once at the end")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                    help="one photo and the N folder once more, with timestamps inside the process")
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="another checkout of gemma4enc (e.g. git archive of an earlier commit): its runs are "
                    "interleaved with this one's, round by round")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "gemma4enc").write_text(SCRIPT)
    ckpt, folder = checkpoint(args.work, args.layers), photos(args.work, args.photos)
    twice = doubled(folder, args.work)
    one = args.work / "one"
    shutil.rmtree(one, ignore_errors=True)
    one.mkdir()
    os.link(sorted(folder.iterdir())[0], one / sorted(folder.iterdir())[0].name)
    trees = {"this": ROOT} | ({"compared": args.compare.resolve()} if args.compare else {})
    envs = {name: os.environ | {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
                                "FIXED_COST_WORK": str(args.work)}
            for name, tree in trees.items()}
    load = os.getloadavg()
    cases = []
    for tree, env in envs.items():
        cases += [((tree, "one"), lambda env=env: ours(one, ckpt, args.work, env)),
                  ((tree, "N"), lambda env=env: ours(folder, ckpt, args.work, env)),
                  ((tree, "2N"), lambda env=env: ours(twice, ckpt, args.work, env))]
    if args.baseline:
        cases.append((("transformers", "N"), lambda: baseline(folder, ckpt, envs["this"])))
    runs: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for (tree, name), fn in cases[:: 1 if r % 2 == 0 else -1]:  # the order alternates between rounds
            runs.setdefault(tree, {}).setdefault(name, []).append(fn())
            print(f"round {r} {tree} {name}: {runs[tree][name][-1]}", flush=True)
    tf = runs.get("transformers", {}).get("N")
    report = {"photos": args.photos, "layers": args.layers, "rounds": args.rounds, "cpu_count": os.cpu_count(),
              "trees": {k: str(v) for k, v in trees.items()}, "loadavg_before": [round(x, 2) for x in load],
              "runs": runs, "best": {}, "per_round": {}}
    for tree in trees:
        by = runs[tree]
        best = {name: min(rs, key=lambda x: x["wall_s"]) for name, rs in by.items()}
        report["best"][tree] = figures(best["one"], best["N"], best["2N"], args.photos,
                                       tf and min(tf, key=lambda x: x["wall_s"]))
        report["per_round"][tree] = [figures(by["one"][r], by["N"][r], by["2N"][r], args.photos, tf and tf[r])
                                     for r in range(args.rounds)]
    if args.trace:
        report["trace"] = {}
        for tree, env in envs.items():
            for name, where in (("one", one), ("N", folder)):
                traced = ours(where, ckpt, args.work, env, trace=True)
                report["trace"].setdefault(tree, {})[name] = {
                    "wall_s": traced["wall_s"], "cpu_s": traced["cpu_s"], "pipeline_s": traced["pipeline_s"],
                    "parts_s": parts(traced["marks"], traced["wall_s"]), "marks": traced["marks"]}
    if args.overlap:
        report["overlap"] = overlap(folder, envs["this"])
    report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps({k: report[k] for k in ("best", "per_round", "loadavg_before", "loadavg_after")}, indent=2))
    if args.trace:
        print(json.dumps({t: {k: v["parts_s"] for k, v in by.items()} for t, by in report["trace"].items()}, indent=2))
    if args.overlap:
        print(json.dumps(report["overlap"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
