"""Options: defaults in one place, validation when built (library and CLI alike), the fingerprint."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from typer.testing import CliRunner

from gemma4enc.commands.cli import app
from gemma4enc.errors import UsageError
from gemma4enc.options import Options, Sampling, format_size, parse_size

RUN = CliRunner()


@pytest.mark.parametrize("text, size", [("10M", 10**7), ("1.5G", 15 * 10**8), ("256MB", 256 * 10**6),
                                        ("1GiB", 2**30), ("1000", 1000), ("1", 1), (" 2 kib ", 2048),
                                        ("0.5KB", 500), (".5K", 500)])
def test_sizes_people_write_are_read(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.2.3", ".", "0", "0.1", "lots", "", "-1G", "1 GG", "1e9"])
def test_sizes_that_mean_nothing_are_refused(text):
    with pytest.raises(UsageError, match="--shard-size"):
        parse_size(text)


@pytest.mark.parametrize("size", [1, 999, 10**9, 2**30, 256 * 10**6, 3 * 2**20])
def test_the_default_spelling_reads_back(size):
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("size, text", [(2**30, "1GiB"), (3 * 2**20, "3MiB"), (10**9, "1GB"), (256 * 10**6, "256MB"),
                                        (1000, "1KB"), (1536, "1536"), (999, "999"), (1, "1")])
def test_sizes_are_spelled_in_the_largest_exact_unit(size, text):
    assert format_size(size) == text  # binary first: 2³⁰ is 1GiB, never 1073741824


@pytest.mark.parametrize("kw, flag", [
    ({"batching": "fast"}, "--batching"), ({"image_tokens": 100}, "--max-soft-tokens"),
    ({"video_tokens": 71}, "--video-soft-tokens"), ({"dtype": "half"}, "--dtype"), ({"out_dtype": "int8"}, "--out-dtype"),
    ({"device": "gpu"}, "--device"), ({"device": "cuda:x"}, "--device"), ({"devices": ","}, "--devices"),
    ({"devices": "cuda:0,tpu"}, "--devices"), ({"video_backend": "opencv"}, "--video-backend"),
    ({"engine": "spark"}, "--engine"), ({"max_batch_patches": 0}, "--max-batch-patches"),
    ({"shard_bytes": 0}, "--shard-size"), ({"memory_fraction": 0}, "--memory-fraction"),
    ({"memory_fraction": 1.5}, "--memory-fraction"), ({"workers": -1}, "--workers"),
    ({"decode_timeout": 0}, "--decode-timeout"), ({"flush_seconds": -1}, "--flush-seconds"),
    ({"max_failures": -1}, "--max-failures"), ({"task_files": 0}, "--task-files"),
    ({"ray_actors": 2}, "--ray-actors need --engine ray"), ({"engine": "ray", "devices": "all"}, "--devices"),
    ({"sampling": Sampling(frames=0)}, "--frames"), ({"sampling": Sampling(fps=-1.0)}, "--fps"),
    ({"model": ""}, "--model"),
])
def test_options_refuse_what_cannot_run(kw, flag):
    """A library caller gets the same one-line error as the command line, before anything runs."""
    with pytest.raises(UsageError, match=flag.replace("-", r"\-")):
        Options(**kw)


def test_the_defaults_are_valid_and_the_cli_takes_them_from_options():
    import typer.main

    default = Options()
    params = {p.name: p.default for p in typer.main.get_command(app).commands["encode"].params}
    assert parse_size(params["shard_size"]) == default.shard_bytes == 2**30  # once 10⁹ here, 2³⁰ there
    for name in ("model", "dtype", "device", "image_tokens", "video_tokens", "batching", "out_dtype", "pooled",
                 "decode_timeout", "flush_seconds", "task_files", "max_image_pixels", "memory_fraction"):
        assert params[name] == getattr(default, name), name
    assert (params["frames"], params["fps"], params["max_frames"]) == (32, None, 32)


def test_the_fingerprint_is_marked_on_the_fields():
    marked = {f.name for f in fields(Options) if f.metadata.get("fingerprint")}
    assert marked == {"model", "dtype", "image_tokens", "video_tokens", "resize", "seek", "sampling", "out_dtype", "pooled",
                      "store"}
    assert set(Options(dtype="float32").fingerprint()) == marked
    assert Options(dtype="float32").fingerprint() != Options(dtype="bfloat16").fingerprint()
    assert Options(pooled=False).fingerprint() != Options().fingerprint()
    assert Options(store="pooled").fingerprint() != Options().fingerprint()
    assert Options(workers=3, batching="pack").fingerprint() == Options().fingerprint()  # speed, not output


def test_plan_validates_and_models_fps(tmp_path):
    from gemma4enc.dev.demo import write_video

    write_video(tmp_path / "clip.mp4", frames=60, fps=30)  # 2 s
    bad = RUN.invoke(app, ["plan", str(tmp_path), "--max-soft-tokens", "100"])
    assert bad.exit_code == 2 and "--max-soft-tokens 100" in bad.output
    by = {}
    for args in (["--frames", "8"], ["--fps", "2"], ["--fps", "30", "--max-frames", "5"]):
        result = RUN.invoke(app, ["plan", str(tmp_path), "--json", *args])
        assert result.exit_code == 0, result.output
        by[args[1]] = json.loads(result.stdout)["tower_items"]
    assert by == {"8": 8, "2": 4, "30": 5}


def test_settings_record_the_dtype_the_tower_ran_in_and_pooled(ckpt, tmp_path):
    """auto is resolved before it is recorded: a float32 folder refuses a bfloat16 run, and one
    with pooled tokens a run without them."""
    from gemma4enc.dev.demo import write_images
    from gemma4enc.model.load import cpu_has_amx

    write_images(tmp_path / "media")
    out = tmp_path / "out"
    base = ["encode", str(tmp_path / "media"), "-o", str(out), "--model", str(ckpt), "--device", "cpu", "-q",
            "--include", "tiny.png"]
    first = RUN.invoke(app, [*base, "--dtype", "auto"])
    assert first.exit_code == 0, first.output
    settings = json.loads((out / "settings.json").read_text())
    assert settings["dtype"] == ("bfloat16" if cpu_has_amx() else "float32") and settings["pooled"] is True
    other = "float32" if settings["dtype"] == "bfloat16" else "bfloat16"
    for args in (["--dtype", other], ["--dtype", settings["dtype"], "--no-pooled"]):
        result = RUN.invoke(app, [*base, *args])
        assert result.exit_code == 2 and "other settings" in result.output, args
    assert RUN.invoke(app, [*base, "--dtype", settings["dtype"]]).exit_code == 0


def test_importing_and_decoding_leave_the_hosts_settings_alone(tmp_path):
    """A library user's umask and Pillow settings are theirs: gemma4enc neither sets them at import
    nor leaves its own after a decode."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "os.umask(0o027)\n"
        "from PIL import Image, ImageFile\n"
        "Image.MAX_IMAGE_PIXELS = 1234567; ImageFile.LOAD_TRUNCATED_IMAGES = True\n"
        "import gemma4enc, gemma4enc.commands.cli, gemma4enc.media.workers, gemma4enc.output.shards\n"
        "from gemma4enc.media.decode import decode_image\n"
        f"Image.new('RGB', (64, 48)).save({str(tmp_path / 'a.png')!r})\n"
        f"assert decode_image({str(tmp_path / 'a.png')!r}, 10_000).images[0].size == (64, 48)\n"
        "mask = os.umask(0); os.umask(mask)\n"
        "print(oct(mask), Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0o27", "1234567", "True"]


def test_resume_takes_what_settings_json_records_for_the_settings_not_given():
    saved = {"model": "/ckpt", "dtype": "float32", "image_tokens": 70, "out_dtype": "float16", "store": "tokens",
             "sampling": {"frames": 8, "fps": None, "max_frames": 32}, "revision": None}
    options, notes = Options.resume(saved, {"image_tokens": 280, "workers": 3, "frames": 16}, {"workers", "frames"},
                                    where="OUT/settings.json")
    assert (options.model, options.dtype, options.image_tokens, options.out_dtype) == ("/ckpt", "float32", 70, "float16")
    assert options.sampling == Sampling(frames=16) and options.workers == 3  # given: kept
    assert notes == ["as OUT/settings.json records: model /ckpt, dtype float32, image_tokens 70, out_dtype float16"]


def test_resume_without_settings_is_the_flags_and_warns_of_flags_without_effect():
    options, notes = Options.resume(None, {"fps": 2.0, "frames": 8}, {"fps", "frames"})
    assert options == Options(sampling=Sampling(frames=None, fps=2.0, max_frames=32))
    assert notes == ["warning: --frames has no effect with --fps (--max-frames caps the frames); ignored"]
    options, notes = Options.resume({"sampling": {"frames": None, "fps": 1.0, "max_frames": 4}}, {}, set())
    assert options.sampling == Sampling(frames=None, fps=1.0, max_frames=4)


def test_resume_checks_what_it_builds():
    with pytest.raises(UsageError, match="--max-soft-tokens"):
        Options.resume({"image_tokens": 71}, {}, set())
