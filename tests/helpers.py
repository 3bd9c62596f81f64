"""Plain functions the tests share: running the CLI, test media, reading OUT back, reference features.

Fixtures live in conftest.py; a test module imports from here, never from another test module.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from gemma4enc.commands.cli import app

RUN = CliRunner()

# ── flags ────────────────────────────────────────────────────────────────────────────────────────

# what most test runs pass: the CPU, the processor's exact pixels, float32 throughout (so tokens can
# be held to transformers' within 1e-4), 4 frames per clip, a JSON summary on stdout and no progress
DEFAULT_FLAGS = {"device": "cpu", "resize": "exact", "dtype": "float32", "out_dtype": "float32", "frames": 4,
                 "json": True, "quiet": True}
SHORT = {"quiet": "-q"}


def flags(**overrides) -> list[str]:
    """encode's flags, DEFAULT_FLAGS changed by name: `flags(frames=6, json=False)`.

    A value of True is a bare flag (--json), None or False leaves the flag out, anything else is
    `--name value` (underscores become dashes). New names go after the defaults, in the order given."""
    given = DEFAULT_FLAGS | overrides
    argv = []
    for name, value in given.items():
        if value is None or value is False:
            continue
        flag = SHORT.get(name, "--" + name.replace("_", "-"))
        argv += [flag] if value is True else [flag, str(value)]
    return argv


BASE = flags()  # the defaults, as a list: `encode([media, "-o", out, "--model", ckpt, *BASE])`

# ── running the CLI ──────────────────────────────────────────────────────────────────────────────


def encode(args, input=None):
    """`gemma4enc encode ARGS` in this process; every way out must be an exit code, no traceback."""
    result = RUN.invoke(app, ["encode", *map(str, args)], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output
    return result


def encode_argv(*args) -> list[str]:
    """The command line of `gemma4enc encode ARGS` in a process of its own (for kill -9 and signals)."""
    return [sys.executable, "-m", "gemma4enc", "encode", *map(str, args)]


def encode_in_subprocess(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(encode_argv(*args), capture_output=True, text=True, timeout=timeout)


def verify(out: Path) -> dict:
    """`gemma4enc verify OUT --json`: the report, whose ok must agree with the exit code."""
    result = RUN.invoke(app, ["verify", str(out), "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == (0 if report["ok"] else 1)
    return report


# ── reading OUT ──────────────────────────────────────────────────────────────────────────────────


def shard_tokens(out):
    """(manifest rows, {path: tokens}) read with nothing but json and safetensors."""
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    tokens = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        with safe_open(str(out / row["shard"]), framework="pt") as f:
            offsets = f.get_tensor("item_offsets")
            lo, hi = offsets[row["index"]].item(), offsets[row["index"] + 1].item()
            tokens[row["path"]] = f.get_tensor("tokens")[lo:hi]
    return rows, tokens


def by_name(out: Path) -> dict[str, dict]:
    """Manifest rows by file name; a file with two rows fails."""
    lines = (out / "manifest.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    names = [Path(r["path"]).name for r in rows]
    assert len(names) == len(set(names)), "a file has two rows"
    return dict(zip(names, rows))


# ── media ────────────────────────────────────────────────────────────────────────────────────────

# (height, width): 8+ aspect ratios, from panoramas to slivers, tiny to large
SHAPES = [(480, 640), (512, 512), (1080, 1920), (300, 1200), (100, 3000), (3000, 90), (37, 41), (640, 480), (700, 90)]


def photo(h: int, w: int, seed: int = 0) -> Image.Image:
    """A gradient with noise: smooth enough to compress, busy enough that every patch differs."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w, 1)), (yy * 255 // max(h, 1)), ((xx + yy) % 256)], -1)
    noise = rng.integers(-30, 30, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


# ── the reference: transformers ──────────────────────────────────────────────────────────────────


def reference(folder, dtype=torch.float32):
    """What a transformers user gets: the full model through from_pretrained."""
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


def hf_image_features(ref, image, budget=280):
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,
    )

    feats = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[image], return_tensors="pt")
    dtype = ref.model.vision_tower.patch_embedder.input_proj.weight.dtype
    with torch.no_grad():
        out = ref.model.get_image_features(feats["pixel_values"].to(dtype), image_position_ids=feats["image_position_ids"])
    return out.pooler_output[0].float()


def close(a, b, rel):
    """Max abs difference within rel × max|b|."""
    scale = b.abs().max().item()
    return (a.float() - b).abs().max().item() <= rel * scale


# ── an output folder with history: what export and search are tested on ─────────────────────────


def folder_with_history(root: Path, ckpt) -> tuple[Path, Path]:
    """(media, out): five photos (one a byte copy of another), a clip and a broken file, encoded
    into one shard per file (--shard-size 1KB) in bfloat16 with --hash; then one photo changed
    (its first row superseded) and one turned to garbage (its latest row failed), encoded again."""
    from gemma4enc.dev.demo import write_video

    media = root / "media"
    (media / "sub").mkdir(parents=True)
    for i, (h, w) in enumerate([(200, 300), (300, 200), (120, 480), (256, 256)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    (media / "sub" / "copy.png").write_bytes((media / "p0.png").read_bytes())
    write_video(media / "clip.mp4", frames=12)
    (media / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    out = root / "out"
    args = [media, "-o", out, "--model", ckpt, *flags(out_dtype="bfloat16", frames=3, json=False),
            "--workers", "0", "--max-soft-tokens", "70", "--shard-size", "1KB", "--hash"]
    assert encode(args).exit_code == 1  # broken.png
    photo(210, 330, seed=9).save(media / "p1.png")  # changed: a new row, the old one superseded
    (media / "p3.png").write_bytes(b"garbage now")  # its latest row fails, its old ok row is superseded
    assert encode(args).exit_code == 1
    return media, out


@contextlib.contextmanager
def loopback_s3(*buckets: str, front=None):
    """A moto S3 server on loopback, found by s3fs (and by every process started meanwhile: Ray's
    nodes, worker processes) through the usual AWS_* variables; yields (s3fs filesystem, front).
    `front(upstream_url)`: a proxy to put between them (faulty_store.FaultyProxy), started here."""
    import pytest
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = front(f"http://{host}:{port}").start() if front else None
    env = {"AWS_ENDPOINT_URL": proxy.url if proxy else f"http://{host}:{port}",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            s3fs.S3FileSystem.clear_instance_cache()
            fs = s3fs.S3FileSystem()
            for bucket in buckets:
                fs.mkdir(bucket)
            yield fs, proxy
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        if proxy:
            proxy.stop()
        server.stop()


def ray_worker_hook(env: str, body: str, module: str = "gemma4enc.run.pipeline", name: str = "_encode",
                    first: str = "window", own: str = "encode") -> str:
    """A sitecustomize.py for Ray's worker processes that see `env` set: `body` runs (as the code of
    a function of `first`, *args, **kwargs) in place of `name` in `module` (a function, or a
    method as "Class.method"), whose own function is `own`: by default the pipeline's `_encode`,
    as `encode`. What the OOM killer, a segfault or a hang does to an actor, on cue."""
    import textwrap

    owner, _, attr = name.rpartition(".")
    holder = f"module.{owner}" if owner else "module"
    return f'''
import os, sys
if os.environ.get("{env}") and "default_worker.py" in " ".join(sys.argv):
    import importlib.abc, importlib.util

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "{module}":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                {own} = {holder}.{attr}

                def {attr}({first}, *args, **kwargs):
{textwrap.indent(textwrap.dedent(body).strip(), " " * 20)}
                {holder}.{attr} = {attr}
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())
'''
