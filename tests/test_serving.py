"""Serving from an OUT (gemma4enc.serving): `export --to vllm` in vLLM's encoder-cache layout, the key
scheme (content hash + shape settings) stable across re-runs, paths and stores, the cache that the
connector serves from (local and s3:// by byte range, read-only), and the request dicts. vLLM itself
runs in scripts/vllm_check.sh (its own venv); here nothing of vLLM is needed or imported."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import gemma4enc
from gemma4enc.serving.cache import KEY_RE, STAND_IN, OutCache, key_of
from gemma4enc.serving.requests import export_index, request

from .helpers import RUN, app, encode, flags, loopback_s3


@pytest.fixture(scope="module")
def served(good, ckpt, tmp_path_factory):
    """good's media encoded with --hash (float32, --resize torchvision) and without it (bfloat16)."""
    root = tmp_path_factory.mktemp("served")
    hashed, plain = root / "hashed", root / "plain"
    assert encode([good, "-o", hashed, "--model", ckpt, *flags(resize="torchvision"), "--hash",
                   "--workers", "0"]).exit_code == 0
    assert encode([good, "-o", plain, "--model", ckpt, *flags(resize="torchvision", out_dtype="bfloat16"),
                   "--workers", "0"]).exit_code == 0
    return good, hashed, plain


def export(out, dest, *more):
    result = RUN.invoke(app, ["export", str(out), str(dest), "--to", "vllm", "--json", *more])
    return result, (json.loads(result.stdout) if result.exit_code == 0 else None)


def test_export_is_vllms_layout_with_the_tokens_and_a_documented_key(served, tmp_path):
    media, hashed, _ = served
    result, report = export(hashed, tmp_path / "ec")
    assert result.exit_code == 0, result.output
    emb = gemma4enc.open(hashed)
    index = export_index(tmp_path / "ec")
    ok = [json.loads(line) for line in (hashed / "manifest.jsonl").read_text().splitlines()]
    ok = [r for r in ok if r["status"] == "ok"]
    assert report["rows"] == len(index) == len(ok) > 0 and report["unkeyed"] == 0
    settings = json.loads((hashed / "settings.json").read_text())
    for row in ok:
        entry = index[row["path"]]
        content = hashlib.sha256(open(row["path"], "rb").read()).hexdigest()
        assert entry["key"] == key_of(row["kind"], content, settings) and KEY_RE.match(entry["key"])
        files = load_file(tmp_path / "ec" / entry["key"] / "encoder_cache.safetensors")
        assert list(files) == ["ec_cache"] and files["ec_cache"].dtype == torch.float32
        assert torch.equal(files["ec_cache"], emb[row["path"]].float())  # a video: its frames in order
        assert files["ec_cache"].shape[0] == row["tokens"]
    # the dtype asked, and the same keys again
    result, _ = export(hashed, tmp_path / "ec16", "--dtype", "bfloat16")
    assert result.exit_code == 0
    again = export_index(tmp_path / "ec16")
    assert {p: r["key"] for p, r in again.items()} == {p: r["key"] for p, r in index.items()}
    some = next(iter(again.values()))["key"]
    assert load_file(tmp_path / "ec16" / some / "encoder_cache.safetensors")["ec_cache"].dtype == torch.bfloat16
    # a folder with other files is refused; --overwrite removes only what an export wrote
    (tmp_path / "ec" / "mine.txt").write_text("keep")
    assert export(hashed, tmp_path / "ec")[0].exit_code == 2
    assert export(hashed, tmp_path / "ec", "--overwrite")[0].exit_code == 0
    assert (tmp_path / "ec" / "mine.txt").read_text() == "keep"


def test_export_of_what_is_not_an_out_is_refused_in_one_line(tmp_path):
    result, _ = export(tmp_path / "nothing", tmp_path / "ec")
    assert result.exit_code == 2 and "not a gemma4enc output folder" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "ec").exists()


def test_keys_survive_a_moved_folder_and_a_rerun_and_hash_files_without_hash(served, tmp_path, ckpt):
    media, hashed, plain = served
    keys = {os.path.basename(p): e.key for p, e in OutCache(str(hashed)).by_path.items()}
    # without --hash: each file hashed here, its size and mtime still the row's: the same keys
    cache = OutCache(str(plain))
    assert cache.hashed == len(keys) and not cache.unkeyed
    assert {os.path.basename(p): e.key for p, e in cache.by_path.items()} == keys
    # the media moved, encoded again into a new OUT: the same keys under other paths
    moved = tmp_path / "moved"
    shutil.copytree(media, moved)
    out2 = tmp_path / "out2"
    assert encode([moved, "-o", out2, "--model", ckpt, *flags(resize="torchvision"), "--hash",
                   "--workers", "0"]).exit_code == 0
    assert {os.path.basename(p): e.key for p, e in OutCache(str(out2)).by_path.items()} == keys
    # a file changed after its encode (new mtime): left out, not served stale tokens
    victim = next(p for p in cache.by_path if p.endswith(".jpg"))
    st = os.stat(victim)
    os.utime(victim, ns=(0, 0))
    try:
        assert victim in OutCache(str(plain)).unkeyed
    finally:
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    # other settings, other keys
    other = tmp_path / "other"
    assert encode([media, "-o", other, "--model", ckpt, *flags(resize="exact"), "--hash",
                   "--workers", "0"]).exit_code == 0
    assert not set(keys.values()) & {e.key for e in OutCache(str(other)).by_path.values()}


def test_the_cache_reads_an_s3_out_by_range_and_writes_nothing(served, tmp_path, ckpt):
    media, hashed, _ = served
    local = OutCache(str(hashed))
    with loopback_s3("serve") as (fs, _):
        assert encode([media, "-o", "s3://serve/emb", "--model", ckpt, *flags(resize="torchvision"), "--hash",
                       "--workers", "0"]).exit_code == 0
        before = {p: fs.info(p)["ETag"] for p in fs.find("serve")}
        remote = OutCache("s3://serve/emb")
        assert set(remote.by_key) == set(local.by_key)
        for key in local.by_key:
            assert torch.equal(remote.tokens(key), local.tokens(key))
        result, report = export("s3://serve/emb", tmp_path / "from-s3")
        assert result.exit_code == 0 and report["rows"] == len(local.by_key)
        assert {p: fs.info(p)["ETag"] for p in fs.find("serve")} == before  # read-only


def test_requests_carry_the_keys_and_stand_ins_of_the_files_size(served):
    _, hashed, _ = served
    cache = OutCache(str(hashed))
    image = next(p for p, e in cache.by_path.items() if e.row["kind"] == "image")
    video = next(p for p, e in cache.by_path.items() if e.row["kind"] == "video")
    req = request(cache, [image, video], "Compare <|image|> with <|video|>.")
    assert req["multi_modal_uuids"] == {"image": [cache.key(image)], "video": [cache.key(video)]}
    stand = req["multi_modal_data"]["image"][0]
    row = cache.by_path[image].row
    assert stand.size == (row["width"], row["height"])  # the file's size, every pixel the stand-in mark
    assert stand.getcolors() == [(row["width"] * row["height"], STAND_IN)]
    frames, meta = req["multi_modal_data"]["video"][0]
    vrow = cache.by_path[video].row
    assert frames.shape == (len(vrow["frame_indices"]), vrow["height"], vrow["width"], 3)
    assert (frames.reshape(-1, 3) == STAND_IN).all()
    assert meta["frames_indices"] == vrow["frame_indices"] and meta["do_sample_frames"] is False
    with pytest.raises(ValueError):
        request(cache, [image], "no placeholder here")
    with pytest.raises(KeyError):
        request(cache, ["/nowhere.jpg"], "<|image|>")


@pytest.mark.parametrize("planted", ["fifo", "dev-zero-link"])
def test_a_planted_settings_file_cannot_hang_the_serving_reader(served, tmp_path, planted):
    """The serving reader runs in vLLM's server: a handed-over OUT whose settings.json is a FIFO
    (a read that never returns) or a link to /dev/zero (one that never ends) is refused at once,
    as gemma4enc's own commands refuse it, not read."""
    import os
    import shutil

    out = tmp_path / "out"
    shutil.copytree(served[1], out)
    (out / "settings.json").unlink()
    if planted == "fifo":
        os.mkfifo(out / "settings.json")
    else:
        (out / "settings.json").symlink_to("/dev/zero")
    code = f"from gemma4enc.serving.cache import OutCache; OutCache({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "MemoryError" not in done.stderr, done.stderr
    assert "not a regular file" in done.stderr or "Too many levels of symbolic links" in done.stderr, done.stderr


def test_the_serving_modules_import_nothing_of_vllm_or_the_cli():
    code = ("import sys, gemma4enc, gemma4enc.serving, gemma4enc.serving.cache, gemma4enc.serving.requests;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'transformers', 'typer', 'rich', 'av')"
            " or m.startswith('gemma4enc.') and m not in ('gemma4enc.output', 'gemma4enc.output.names')"
            " and not m.startswith(('gemma4enc.serving', 'gemma4enc._version'))];"
            "print(bad)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_stand_in_files_carry_what_the_openai_api_can(served):
    """Over HTTP a request carries files: a PNG stand-in of the image's size, and for a video a
    lossless clip of one stand-in frame per sampled frame at a rate that keeps their mm:ss
    timestamps (what vLLM's prompt is made of); indices no constant rate reproduces are refused."""
    import io

    import av
    from PIL import Image

    from gemma4enc.serving.requests import stand_in_file, stand_in_rate

    _, hashed, _ = served
    cache = OutCache(str(hashed))
    image = next(e.row for e in cache.by_path.values() if e.row["kind"] == "image")
    data, mime = stand_in_file(image)
    assert mime == "image/png"
    png = Image.open(io.BytesIO(data))
    assert png.size == (image["width"], image["height"])
    assert png.convert("RGB").getcolors() == [(image["width"] * image["height"], STAND_IN)]
    video = next(e.row for e in cache.by_path.values() if e.row["kind"] == "video")
    data, mime = stand_in_file(video)
    assert mime == "video/x-matroska"
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        rate = float(stream.average_rate)
    assert len(frames) == len(video["frame_indices"])
    assert all((f.reshape(-1, 3) == STAND_IN).all() and f.shape[:2] == (video["height"], video["width"])
               for f in frames)
    stamp = lambda s: f"{int(s // 60):02d}:{int(s % 60):02d}"  # noqa: E731 - Gemma 4's prompt's
    assert [stamp(i / rate) for i in range(len(frames))] == [stamp(i / video["fps"]) for i in video["frame_indices"]]
    assert stand_in_rate({"frame_indices": [0, 15, 30, 45], "fps": 30.0}) == 2.0
    with pytest.raises(ValueError, match="constant rate"):
        stand_in_rate({"frame_indices": [0, 1, 2, 90], "fps": 30.0})  # 00:00 ×3, then 00:03


def test_sampled_file_holds_the_frames_gemma4enc_sampled(served):
    """A miss on a real video should answer from the frames gemma4enc sampled, not vLLM's own sample
    of the file: sampled_file packs exactly those frames (a plain full decode at the row's indices),
    losslessly, one per sampled frame."""
    import io

    import av
    import numpy as np

    from gemma4enc.serving.requests import sampled_file

    _, hashed, _ = served
    cache = OutCache(str(hashed))
    path, entry = next((p, e) for p, e in cache.by_path.items() if e.row["kind"] == "video")
    data, mime = sampled_file(path, entry.row)
    with av.open(path) as c:
        full = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(io.BytesIO(data)) as c:
        packed = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert mime == "video/x-matroska" and len(packed) == len(entry.row["frame_indices"])
    assert all(np.array_equal(p, full[i]) for p, i in zip(packed, entry.row["frame_indices"]))
