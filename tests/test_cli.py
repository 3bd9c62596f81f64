"""The encode command end to end, through the CLI, read back with plain safetensors + json."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers.image_utils import load_image

import gemma4enc
from gemma4enc.commands.cli import app
from gemma4enc.dev.demo import write_images, write_video
from gemma4enc.output.opening import open_out

from .helpers import BASE, RUN, close, encode, flags, hf_image_features, shard_tokens


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_images(root / "photos")
    Image.fromarray((np.arange(96 * 64).reshape(64, 96) * 10).astype(np.uint16)).save(root / "photos" / "deep.png")
    Image.new("CMYK", (120, 90), (10, 200, 30, 0)).save(root / "photos" / "cmyk.jpg")
    (root / "clips").mkdir()
    write_video(root / "clips" / "a.mp4", frames=30)
    write_video(root / "clips" / "b.webm", frames=20, codec="libvpx-vp9")
    (root / "notes.txt").write_text("skip me")
    (root / ".hidden.jpg").write_bytes((root / "photos" / "landscape.jpg").read_bytes())
    return root


@pytest.fixture(scope="module")
def run(media, ckpt_sharded, tmp_path_factory):
    work = tmp_path_factory.mktemp("run")
    good = work / "media"
    shutil.copytree(media, good)
    (good / "photos" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 100)
    out = work / "out"
    result = encode([good, "-o", out, "--model", ckpt_sharded, *BASE])
    return good, out, result


def test_encode_writes_what_transformers_computes(run, ref_sharded):
    media, out, result = run
    assert result.exit_code == 1, result.output  # one broken file
    summary = json.loads(result.stdout)
    assert summary["failed"] == 1 and summary["encoded"] == 12 and summary["skipped_not_media"] == 1
    assert 0 <= summary["tower_waited_share"] <= 1 and summary["decode_files_per_s_per_worker"] > 0
    rows, tokens = shard_tokens(out)
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)) == 13
    assert not any(p.endswith((".hidden.jpg", "notes.txt")) for p in paths)
    broken = next(r for r in rows if r["path"].endswith("broken.jpg"))
    assert broken["status"] == "decode_error" and broken["error"] and broken["shard"] is None
    for name in ("landscape.jpg", "panorama.jpg", "square.webp", "tall.png", "tiny.png", "cmyk.jpg"):
        path = str(media / "photos" / name)
        want = hf_image_features(ref_sharded, load_image(path))
        assert close(tokens[path], want, 1e-4), name
    for row in rows:
        if row["kind"] == "video":
            assert row["frames"] == 4 == len(row["frame_indices"]) == len(row["timestamps"])
            assert row["tokens"] == sum(row["frame_tokens"]) == tokens[row["path"]].shape[0]
            assert row["frame_indices"] == sorted(row["frame_indices"])


def test_shard_layout_and_reader(run):
    _, out, _ = run
    rows, tokens = shard_tokens(out)
    shard = next(r["shard"] for r in rows if r["shard"])
    with safe_open(str(out / shard), framework="pt") as f:
        meta = f.metadata()
        assert meta["format_version"] == "1" and meta["out_dtype"] == "float32" and meta["image_soft_tokens"] == "280"
        n = f.get_tensor("item_offsets").shape[0] - 1
        assert f.get_tensor("pooled").shape[0] == n
        assert f.get_tensor("frame_offsets")[-1] == f.get_tensor("tokens").shape[0]
    emb = gemma4enc.open(out)
    assert len(emb) == 12
    video = next(r for r in rows if r["kind"] == "video")
    frames = emb.frames(video["path"])
    assert [f.shape[0] for f in frames] == video["frame_tokens"]
    assert torch.equal(torch.cat(frames), tokens[video["path"]])
    assert torch.allclose(emb.pooled(video["path"]), tokens[video["path"]].mean(0), atol=1e-6)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_rerun_does_only_what_changed(run, ckpt_sharded):
    media, out, _ = run
    again = encode([media, "-o", out, "--model", ckpt_sharded, *BASE])
    assert json.loads(again.stdout)["done_before"] == 13 and json.loads(again.stdout)["encoded"] == 0
    other = encode([media, "-o", out, "--model", ckpt_sharded, *flags(frames=6, json=False)])
    assert other.exit_code == 2 and "other settings" in other.output
    keys = encode([media, "-o", out, "--model", ckpt_sharded, *BASE, "--seek", "keyframe"])
    assert keys.exit_code == 2 and "seek: 'exact' → 'keyframe'" in keys.output


def test_bad_file_does_not_change_good_ones(run, media, ckpt_sharded, tmp_path):
    _, out_with_bad, _ = run
    clean = tmp_path / "clean"
    result = encode([media, "-o", clean, "--model", ckpt_sharded, *BASE])
    assert result.exit_code == 0, result.output
    _, with_bad = shard_tokens(out_with_bad)
    _, alone = shard_tokens(clean)
    rename = lambda p: p.replace(str(out_with_bad.parent / "media"), str(media))  # noqa: E731
    assert {rename(p) for p in with_bad} == set(alone)
    for path, t in with_bad.items():
        assert torch.equal(t, alone[rename(path)]), path


def test_bucket_equals_serial_and_pack_is_close(media, ckpt_sharded, tmp_path):
    got = {}
    for mode in ("serial", "bucket", "pack"):
        out = tmp_path / mode
        assert encode([media / "photos", "-o", out, "--model", ckpt_sharded, "--batching", mode, *BASE]).exit_code == 0
        got[mode] = shard_tokens(out)[1]
    for path, serial in got["serial"].items():
        assert torch.equal(got["bucket"][path], serial), path  # bit-identical
        assert close(got["pack"][path], serial, 1e-5), path


def test_several_devices_equal_one_and_share_the_work(media, ckpt_sharded, tmp_path):
    """--devices: one tower per device, windows to the first free one, output bit-equal to one device."""
    from gemma4enc.media.discover import discover
    from gemma4enc.model.load import load_tower
    from gemma4enc.options import Options, Sampling
    from gemma4enc.output.shards import ShardWriter
    from gemma4enc.run.pipeline import run as run_pipeline

    one = encode([media, "-o", tmp_path / "one", "--model", ckpt_sharded, *BASE])
    two = encode([media, "-o", tmp_path / "two", "--model", ckpt_sharded, *BASE, "--devices", "cpu,cpu"])
    assert one.exit_code == two.exit_code == 0, two.output
    assert json.loads(two.stdout)["device"] == "cpu, cpu"
    a, b = shard_tokens(tmp_path / "one")[1], shard_tokens(tmp_path / "two")[1]
    assert set(a) == set(b) and all(torch.equal(a[p], b[p]) for p in a)

    items, _ = discover([str(media)], None, [], [], False)
    towers = [load_tower(str(ckpt_sharded), "float32", "cpu") for _ in range(2)]
    writer = ShardWriter(open_out(tmp_path / "direct"), "float32", {})
    options = Options(workers=0, sampling=Sampling(frames=4))  # as flags()
    summary = run_pipeline(items, towers, options, writer, "serial", 8192, window_patches=3000)
    assert summary.ok == len(items) and len(summary.device_patches) == 2
    assert all(n > 0 for n in summary.device_patches) and sum(summary.device_patches) == summary.patches
    c = shard_tokens(tmp_path / "direct")[1]
    assert set(c) == set(a) and all(torch.equal(c[p], a[p]) for p in a)  # other windows, same tokens


def test_files_from_stdin_and_globs(media, ckpt_sharded, tmp_path):
    listing = f"{media / 'photos' / 'tiny.png'}\n{media / 'notes.txt'}\n"
    result = encode(["--files-from", "-", "-o", tmp_path / "o", "--model", ckpt_sharded, *BASE], input=listing)
    rows, _ = shard_tokens(tmp_path / "o")
    assert {r["status"] for r in rows} == {"ok", "unsupported"} and result.exit_code == 1
    result = encode([media, "--include", "*.png", "--exclude", "tall*", "-o", tmp_path / "g", "--model", ckpt_sharded,
                     *BASE])
    rows, _ = shard_tokens(tmp_path / "g")
    names = sorted(r["path"].rsplit("/", 1)[1] for r in rows)
    assert names == ["alpha.png", "deep.png", "gray.png", "portrait.png", "tiny.png"]


def test_plan_and_inspect(run, media):
    _, out, _ = run
    plan = RUN.invoke(app, ["plan", str(media), "--json"])
    report = json.loads(plan.stdout)
    assert report["by_kind"] == {"image": 10, "video": 2} and report["tokens"] > 0
    inspect = RUN.invoke(app, ["inspect", str(out), "--json"])
    report = json.loads(inspect.stdout)
    assert report["by_status"] == {"ok": 12, "decode_error": 1} and report["missing_shards"] == []


def test_usage_errors_exit_2(media, ckpt_sharded, tmp_path):
    for args in (["--max-soft-tokens", "100"], ["--video-backend", "opencv"], ["--shard-size", "lots"],
                 ["--devices", ","], ["--devices", "cpu,cuda:7"], ["--engine", "spark"],
                 ["--seek", "closest"], ["--seek", "nearest:0"], ["--resize", "quick"]):
        result = encode([media, "-o", tmp_path / "x", "--model", ckpt_sharded, *args])
        assert result.exit_code == 2, args
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = encode([media, "-o", blocker / "out", "--model", ckpt_sharded])
    assert result.exit_code == 2 and "cannot write" in result.output


def test_every_option_is_documented():
    import typer.main

    root = __import__("pathlib").Path(__file__).parents[1]
    readme, details = (root / "README.md").read_text(), (root / "docs" / "commands.md").read_text()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert f"gemma4enc {name}" in readme and f"gemma4enc {name}" in details, name
        for param in command.params:
            if param.param_type_name == "option":  # typer's options are not click.Option subclasses
                assert param.help, (name, param.name)
                assert any(opt in details for opt in param.opts), (name, param.opts)


def test_compile_flag_reaches_the_tower(media, ckpt_sharded, tmp_path, monkeypatch):
    """--compile hands each encoder layer to torch.compile (here a stand-in that records it and
    runs it as is: the compiled numerics are tested in test_tower); the output is unchanged."""
    import torch

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled.append((module, kw)) or module)
    photos = media / "photos"
    plain = encode([photos, "-o", tmp_path / "plain", "--model", ckpt_sharded, *BASE])
    fast = encode([photos, "-o", tmp_path / "fast", "--model", ckpt_sharded, *BASE, "--compile"])
    assert plain.exit_code == fast.exit_code == 0, fast.output
    assert [type(m).__name__ for m, _ in compiled] == ["EncoderLayer"] * 2  # the tiny tower's layers
    assert all(kw == {"dynamic": True} for _, kw in compiled)
    a, b = shard_tokens(tmp_path / "plain")[1], shard_tokens(tmp_path / "fast")[1]
    assert set(a) == set(b) and all(torch.equal(a[p], b[p]) for p in a)


def test_the_summary_says_when_decode_is_the_bottleneck():
    from gemma4enc.run.pipeline import Summary, where_time_went

    facts, verdict = where_time_went(Summary(files=100, seconds=10.0, decode_wait=6.2), workers=8)
    assert facts == {"tower_waited_share": 0.62, "decode_files_per_s_per_worker": 1.25}
    # the towers were busy 3.8 s of 10: 8 workers × 10 / 3.8 ≈ 21 would keep them fed
    assert verdict == "decode-bound: the tower waited 62% of the time; about 21 workers would feed it (now 8)"
    assert where_time_went(Summary(files=100, seconds=10.0, decode_wait=2.0), workers=8)[1] is None


@pytest.mark.parametrize("given, seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_console_script_lets_idle_openmp_threads_sleep_unless_told(given, seen):
    """main() sets OMP_WAIT_POLICY before torch loads OpenMP (docs/benchmarks.md: spinning threads
    on a shared CPU); a value the user set is left alone."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = ("import os, sys\nsys.argv = ['gemma4enc', '--version']\nfrom gemma4enc.commands.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint(os.environ['OMP_WAIT_POLICY'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == seen, done.stderr


def test_an_empty_drop_folder_makes_an_out_every_command_reads(ckpt, tmp_path):
    drop, out = tmp_path / "drop", tmp_path / "out"
    drop.mkdir()
    first = encode([drop, "-o", out, "--model", ckpt, *BASE])
    assert first.exit_code == 0 and json.loads(first.stdout)["encoded"] == 0, first.output
    for command in ("verify", "inspect"):
        result = RUN.invoke(app, [command, str(out), "--json"])
        assert result.exit_code == 0 and json.loads(result.stdout)["files"] == 0, result.output
    assert len(gemma4enc.open(out)) == 0 and len(gemma4enc.open(out, framework="numpy")) == 0
    (drop / "a.png").write_bytes(b"")  # an empty file arrives: it gets its row
    later = encode([drop, "-o", out, "--model", ckpt, *BASE])
    assert later.exit_code == 1 and gemma4enc.open(out).row(drop / "a.png")["status"] == "empty", later.output
