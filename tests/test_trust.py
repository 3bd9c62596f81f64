"""Trustworthy from cron (issue 15): nothing touched that is not ours, settings remembered truly,
re-runs that heal, a log a person can read. Every case goes through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemma4enc.commands.cli import app

from .helpers import BASE, close, encode, flags, photo

RUN = CliRunner()


@pytest.fixture(scope="module")
def pics(tmp_path_factory):
    """Three small photos: enough for a run that takes a second."""
    root = tmp_path_factory.mktemp("pics") / "media"
    root.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80), (48, 120)]):
        photo(h, w, seed=i).save(root / f"p{i}.png")
    return root


def rows_of(out: Path) -> dict[str, dict]:
    rows = {}
    for line in (out / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["path"]] = row
    return rows


def test_only_our_temp_files_are_removed(pics, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".draft.tmp").write_text("the user's")
    (out / "notes.tmp").write_text("the user's too")
    ours = [".gemma4enc-shard-000003.safetensors.4242.tmp", ".shard-000003.safetensors.4242.tmp",
            ".manifest.jsonl.77.tmp", ".write-test-5.tmp"]  # ours now, and the names earlier versions used
    for name in ours:
        (out / name).write_bytes(b"half")
    result = encode([pics, "-o", out, "--model", ckpt, *BASE])
    assert result.exit_code == 0, result.output
    assert not any((out / name).exists() for name in ours)
    report = json.loads(RUN.invoke(app, ["verify", str(out), "--json"]).stdout)
    assert report["ok"] and not report["warnings"]
    result = encode([pics, "-o", out, "--model", ckpt, *BASE, "--overwrite"])
    assert result.exit_code == 0 and json.loads(result.stdout)["encoded"] == 3
    assert (out / ".draft.tmp").read_text() == "the user's" and (out / "notes.tmp").read_text() == "the user's too"


def test_a_run_that_fails_preflight_leaves_nothing_behind(pics, ckpt, tmp_path):
    import subprocess
    import sys

    import torch

    out = tmp_path / "out"
    typo = encode([pics, "-o", out, "--model", f"{ckpt}-typo", *BASE])
    assert typo.exit_code == 2 and "no such checkpoint" in typo.output
    assert not out.exists()  # not even the folder
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    if not torch.cuda.is_available():
        no_gpu = encode([pics, "-o", out, "--model", ckpt, *BASE, "--device", "cuda"])
        assert no_gpu.exit_code == 2 and "CUDA" in no_gpu.output
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    hub = subprocess.run([sys.executable, "-m", "gemma4enc", "encode", str(pics), "-o", str(out), "--model",
                          "someone/no-such-model", "--device", "cpu"], env=env, capture_output=True, text=True)
    assert hub.returncode == 2 and "not in the Hugging Face cache" in hub.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # no settings.json, no lock, no manifest
    fixed = encode([pics, "-o", out, "--model", ckpt, *BASE])
    assert fixed.exit_code == 0 and json.loads(fixed.stdout)["encoded"] == 3, fixed.output


def test_the_same_model_however_it_is_written(pics, ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert encode([pics, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    assert json.loads((out / "settings.json").read_text())["model"] == str(Path(ckpt).resolve())
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    monkeypatch.chdir(Path(ckpt).parent)
    for written in (f"{ckpt}/", Path(ckpt).name, f"./{Path(ckpt).name}/", link, os.path.relpath(link)):
        again = encode([pics, "-o", out, "--model", written, *BASE])
        assert again.exit_code == 0, (written, again.output)
        assert json.loads(again.stdout)["encoded"] == 0, written


def test_settings_are_recorded_checked_and_remembered(pics, ckpt, tmp_path):
    out = tmp_path / "out"
    first = encode([pics, "-o", out, "--model", ckpt, *BASE, "--no-pooled", "--max-soft-tokens", "70"])
    assert first.exit_code == 0, first.output
    settings = json.loads((out / "settings.json").read_text())
    assert settings["dtype"] == "float32" and settings["pooled"] is False and settings["image_tokens"] == 70
    # a re-run with none of those flags, not even --model: they are read back
    bare = RUN.invoke(app, ["encode", str(pics), "-o", str(out), "--device", "cpu", "--json"])
    assert bare.exit_code == 0, bare.output
    assert json.loads(bare.stdout)["done_before"] == 3 and json.loads(bare.stdout)["encoded"] == 0
    assert "settings.json records" in bare.stderr and "image_tokens 70" in bare.stderr
    for flag, name in ((["--pooled"], "pooled"), (["--dtype", "bfloat16"], "dtype"),
                       (["--out-dtype", "float16"], "out_dtype")):
        refused = encode([pics, "-o", out, *flag])
        assert refused.exit_code == 2 and "other settings" in refused.output and name in refused.output, flag
    # a flag without effect is warned about, neither refused nor recorded
    idle = RUN.invoke(app, ["encode", str(pics), "-o", str(out), "--device", "cpu", "--max-frames", "5", "--json"])
    assert idle.exit_code == 0 and "--max-frames has no effect without --fps" in idle.stderr
    assert json.loads((out / "settings.json").read_text()) == settings


def test_reruns_heal_lost_shards_and_verify_repair(pics, ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    import gemma4enc

    pics = shutil.copytree(pics, tmp_path / "media")  # a copy: it moves below
    out = tmp_path / "out"
    assert encode([pics, "-o", out, "--model", ckpt, *BASE, "--shard-size", "1"]).exit_code == 0
    before = {p: gemma4enc.open(out)[p].clone() for p in gemma4enc.open(out)}
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) == 3
    shards[0].unlink()
    shards[1].write_bytes(shards[1].read_bytes()[:200])  # truncated
    assert RUN.invoke(app, ["verify", str(out)]).exit_code == 1
    again = encode([pics, "-o", out, "--model", ckpt, *BASE])
    assert again.exit_code == 0 and json.loads(again.stdout)["encoded"] == 2, again.output
    report = json.loads(RUN.invoke(app, ["verify", str(out), "--json"]).stdout)
    assert report["ok"] and not report["warnings"], report  # the truncated shard is gone, no orphan
    emb = gemma4enc.open(out)
    assert all(torch.equal(emb[p], t) for p, t in before.items())
    # what a header cannot show (a bit flipped to NaN) verify finds, and --repair encodes again
    victim = sorted(out.glob("shard-*.safetensors"))[-1]
    held = sum(r.get("shard") == victim.name for r in rows_of(out).values())
    tensors = load_file(victim)
    tensors["tokens"][0, 0] = float("nan")
    save_file(tensors, victim, metadata={"format_version": "1", "out_dtype": "float32"})
    assert RUN.invoke(app, ["verify", str(out)]).exit_code == 1
    fixed = RUN.invoke(app, ["verify", str(out), "--repair", "--json"])
    assert fixed.exit_code == 0, fixed.output
    report = json.loads(fixed.stdout)
    assert report["ok"] and report["repaired"] == held >= 1 and not report["warnings"]
    emb = gemma4enc.open(out)
    assert all(close(emb[p], t, 1e-5) for p, t in before.items())  # another process: other thread count
    # the repaired rows keep where each file sat: a moved folder is recognised, exports say rel
    rows = rows_of(out)
    assert {(r["root"], r["rel"]) for r in rows.values()} == {(str(pics), Path(p).name) for p in before}
    moved = tmp_path / "moved"
    shutil.copytree(pics, moved, copy_function=shutil.copy2)  # copy2 keeps the mtimes, as a move does
    shutil.rmtree(pics)
    again = encode([moved, "-o", out, "--model", ckpt, *BASE])
    assert again.exit_code == 0 and json.loads(again.stdout)["encoded"] == 0, again.output
    dest = tmp_path / "exported"
    assert RUN.invoke(app, ["export", str(out), str(dest), "--to", "parquet"]).exit_code == 0
    import pyarrow.parquet as pq

    table = pq.read_table(dest / "data").to_pylist()  # once each: the adopted rows superseded the old
    assert sorted((r["path"], r["rel"]) for r in table) == sorted(
        (str(moved / Path(p).name), Path(p).name) for p in before)


def test_files_from_null_listed_folders_and_out_inside_a_root(pics, ckpt, tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    odd = root / "two\nlines.png"
    shutil.copy(pics / "p0.png", odd)
    shutil.copy(pics / "p1.png", root / "sub" / "in-folder.png")
    listing = tmp_path / "list0"
    listing.write_bytes(os.fsencode(odd) + b"\0" + os.fsencode(root / "sub") + b"\0")
    out = tmp_path / "out"
    result = encode(["--files-from", listing, "-0", "-o", out, "--model", ckpt, *BASE])
    assert result.exit_code == 0, result.output
    assert sorted(rows_of(out)) == sorted([str(odd), str(root / "sub" / "in-folder.png")])
    assert all(r["status"] == "ok" for r in rows_of(out).values())
    # OUT inside the root it encodes: never walked, however often it runs
    inner = root / "embeddings"
    for _ in range(2):
        result = encode([root, "-o", inner, "--model", ckpt, *BASE])
        assert result.exit_code == 0 and json.loads(result.stdout)["skipped_not_media"] == 0, result.output
    assert len(rows_of(inner)) == 2 and not any(p.startswith(str(inner)) for p in rows_of(inner))


def test_help_is_plain_and_complete():
    encode_help = RUN.invoke(app, ["encode", "-h"], terminal_width=200)
    assert encode_help.exit_code == 0
    text = encode_help.output
    assert "<bool>" not in text and "pip install 'gemma4enc[ray]'" in text
    assert "--pooled / --no-pooled" in text and "-0, --null" in text
    assert "Exit codes: 0 all ok" in text and "130 interrupted" in text
    top = RUN.invoke(app, ["-h"])
    assert top.exit_code == 0 and "Exit codes" in top.output and "encode" in top.output
    version = RUN.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"gemma4enc {__import__('gemma4enc').__version__}"


def test_a_log_a_person_can_read(pics, ckpt, tmp_path):
    import re
    import subprocess
    import sys

    media = tmp_path / "media"
    shutil.copytree(pics, media)
    (media / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 100)
    out, log = tmp_path / "out", tmp_path / "run.log"
    result = encode([media, "-o", out, "--model", ckpt, *flags(quiet=False), "--log-file", log])
    assert result.exit_code == 1
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d gemma4enc: "
    progress = [line for line in result.stderr.splitlines() if "files (" in line]
    assert progress and all(re.match(stamp, line) and "elapsed" in line and "ETA" in line for line in progress)
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(stamp + r"3 ok, 1 failed \(decode_error 1\); OUT holds 1 shard\(s\), [\d.,]+ KB; \d+ s$", last), last
    logged = log.read_text().splitlines()
    assert all(re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line) for line in logged)
    assert any("1 file(s) failed" in line for line in logged) and logged[-1].endswith(last.split(" ", 2)[2])
    # -q: nothing on stderr, the log file still gets it all
    quiet = encode([media, "-o", out, "--model", ckpt, *BASE, "--log-file", log])
    assert quiet.exit_code == 0 and quiet.stderr == "" and "0 ok, 0 failed, 4 done before" in log.read_text()
    # inspect: aligned lines, no Python reprs; a run in progress is named
    shown = RUN.invoke(app, ["inspect", str(out)]).output.splitlines()
    assert not any("{" in line or "[" in line for line in shown)
    assert len({line.index(line.split()[-1]) for line in shown if line.startswith(("files ", "tokens ", "shards "))}) == 1
    status = next(line for line in shown if line.startswith("by status "))
    assert sorted(status.split(None, 2)[2].split(", ")) == ["decode_error 1", "ok 3"]
    hold = ("import sys, time; from pathlib import Path; from gemma4enc.output.lock import Lock; "
            "Lock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = RUN.invoke(app, ["inspect", str(out)]).output
        assert re.search(rf"^running +pid {holder.pid} on ", busy, re.M), busy
    finally:
        holder.kill()
        holder.wait()
    assert re.search(r"^running +–$", RUN.invoke(app, ["inspect", str(out)]).output, re.M)  # killed: not running
    plan = RUN.invoke(app, ["plan", str(media)]).output.splitlines()
    assert any(re.match(r"^by kind +image 4$", line) for line in plan) and not any("{" in line for line in plan)


def test_reader_failed_files_and_numpy_without_torch(pics, ckpt, tmp_path):
    import subprocess
    import sys

    import numpy as np
    import torch

    import gemma4enc

    media = tmp_path / "media"
    shutil.copytree(pics, media)
    (media / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 100)
    from gemma4enc.dev.demo import write_video

    write_video(media / "clip.mp4", frames=8)
    out = tmp_path / "out"
    args = [media, "-o", out, "--model", ckpt, "--device", "cpu", "--dtype", "float32", "--frames", "3", "-q"]
    assert encode(args).exit_code == 1  # bfloat16 output, the default
    emb = gemma4enc.open(out)
    broken = str(media / "broken.jpg")
    for read in (emb.__getitem__, emb.pooled, emb.frames):
        with pytest.raises(KeyError, match="status decode_error"):
            read(broken)
    flat = gemma4enc.open(out, framework="numpy")
    assert len(flat) == len(emb) == 4
    for path in emb:
        want = emb[path]
        assert want.dtype == torch.bfloat16
        got = flat[path]
        assert got.dtype == np.float32 and np.array_equal(got, want.float().numpy())
        assert np.array_equal(flat.pooled(path), emb.pooled(path).float().numpy())
        assert [f.shape[0] for f in flat.frames(path)] == emb.row(path)["frame_tokens"]
    with pytest.raises(KeyError, match="status decode_error"):
        flat.pooled(broken)
    # in a process where torch cannot be imported at all
    code = ("import sys; sys.modules['torch'] = None; import gemma4enc; "
            f"emb = gemma4enc.open({str(out)!r}, framework='numpy'); "
            f"print(float(abs(emb[{str(media / 'p0.png')!r}]).sum()))")
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    assert float(alone.stdout) == pytest.approx(float(emb[str(media / "p0.png")].float().abs().sum()), rel=1e-6)
    no_pool = tmp_path / "nopool"
    assert encode([pics, "-o", no_pool, "--model", ckpt, *BASE, "--no-pooled"]).exit_code == 0
    with pytest.raises(KeyError, match="--no-pooled"):
        gemma4enc.open(no_pool).pooled(str(pics / "p0.png"))


def test_offline_without_hf_hub_offline_fails_fast(pics, tmp_path):
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": "http://nonexistent.invalid", "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "out"

    def timed(model: str):
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "gemma4enc", "encode", str(pics), "-o", str(out), "--model",
                                 model, "--device", "cpu"], env=env, capture_output=True, text=True)
        return result, time.monotonic() - start

    # side by side with a typo that fails on the spot (the same imports): on a loaded machine a bare
    # start alone can take half a minute, so the bound is on the difference; the retries sleep ~23 s
    _, baseline = timed(str(tmp_path / "typo"))
    result, seconds = timed("someone/some-model")
    assert result.returncode == 2, result.stderr
    assert "HF_HUB_OFFLINE=1" in result.stderr and "nonexistent.invalid" in result.stderr
    assert "Retrying" not in result.stderr and seconds - baseline < 15, (seconds, baseline)
    assert not out.exists()


def test_plan_reads_the_width_takes_the_sampling_flags_and_warns(pics, ckpt, tmp_path):
    from gemma4enc.dev.demo import write_video
    from gemma4enc.model.checkpoint import find_checkpoint

    media = tmp_path / "media"
    shutil.copytree(pics, media)
    write_video(media / "clip.mp4", frames=60, fps=30)  # 2 s
    sampling = ["--fps", "4", "--max-frames", "6"]
    plan = RUN.invoke(app, ["plan", str(media), "--model", str(ckpt), *sampling, "--json"])
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.stdout)
    out = tmp_path / "out"
    encoded = encode([media, "-o", out, "--model", ckpt, *flags(frames=None, fps=4, max_frames=6)])
    assert encoded.exit_code == 0, encoded.output
    summary = json.loads(encoded.stdout)
    assert report["tower_items"] == summary["frames"] == 3 + 6 and report["tokens"] == summary["tokens"]
    width = find_checkpoint(str(ckpt)).config.text_config.hidden_size
    assert width != 1536 and report["output_bytes"] == report["tokens"] * width * 2  # bfloat16
    missing = RUN.invoke(app, ["plan", str(media), str(tmp_path / "typo")])
    assert missing.exit_code == 0 and f"warning: {tmp_path / 'typo'}: no such file or folder" in missing.stderr


def test_plan_into_out_uses_the_settings_out_records(pics, ckpt, tmp_path):
    """plan -o OUT without flags plans what encode -o OUT without flags then does (OUT's budgets, sampling, width)."""
    from gemma4enc.dev.demo import write_video
    from gemma4enc.model.checkpoint import find_checkpoint

    media = tmp_path / "media"
    shutil.copytree(pics, media)
    out = tmp_path / "out"
    first = encode([media, "-o", out, "--model", ckpt, *flags(max_soft_tokens=70, video_soft_tokens=140, frames=3,
                                                              out_dtype="float16")])
    assert first.exit_code == 0, first.output
    write_video(media / "clip.mp4", frames=30)
    photo(90, 60, seed=7).save(media / "new.png")
    plan = RUN.invoke(app, ["plan", str(media), "-o", str(out), "--json"])
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.stdout)
    again = encode([media, "-o", out, "--device", "cpu", "--json", "-q"])
    assert again.exit_code == 0, again.output
    summary = json.loads(again.stdout)
    assert summary["encoded"] == 2 and report["tower_items"] == summary["frames"] == 1 + 3
    assert report["tokens"] == summary["tokens"] and report["done_before"] == 3
    width = find_checkpoint(str(ckpt)).config.text_config.hidden_size
    assert report["output_bytes"] == report["tokens"] * width * 2  # float16, OUT's width
    given = json.loads(RUN.invoke(app, ["plan", str(media), "-o", str(out), "--max-soft-tokens", "280",
                                        "--hidden-size", "8", "--json"]).stdout)
    assert given["output_bytes"] == given["tokens"] * 8 * 2  # what is given wins


def test_a_moved_folder_is_not_encoded_again(pics, ckpt, tmp_path):
    import torch

    import gemma4enc

    old = tmp_path / "disk1" / "media"
    shutil.copytree(pics, old / "sub")
    out = tmp_path / "out"
    assert encode([old, "-o", out, "--model", ckpt, *BASE]).exit_code == 0
    before = {os.path.relpath(p, old): gemma4enc.open(out)[p].clone() for p in gemma4enc.open(out)}
    assert {r["rel"] for r in rows_of(out).values()} == set(before)
    new = tmp_path / "disk2" / "elsewhere"
    new.parent.mkdir()
    shutil.move(old, new)  # a rename keeps the mtimes, as a remount does
    again = encode([new, "-o", out, "--model", ckpt, *BASE])
    assert again.exit_code == 0 and json.loads(again.stdout)["encoded"] == 0, again.output
    emb = gemma4enc.open(out)
    for rel, tokens in before.items():
        row = emb.row(new / rel)
        assert row["root"] == str(new) and row["rel"] == rel and torch.equal(emb[new / rel], tokens)
    # turning on --hash encodes again what has no hash (a row cannot say which bytes it came from)
    hashed = encode([new, "-o", out, "--model", ckpt, *BASE, "--hash"])
    assert hashed.exit_code == 0 and json.loads(hashed.stdout)["encoded"] == len(before)
    assert all(emb_row.get("sha256") for p, emb_row in rows_of(out).items() if p.startswith(str(new)))
    # copied elsewhere (new mtimes): with --hash the content decides, and it is the same
    copy = tmp_path / "copy"
    shutil.copytree(new, copy, copy_function=shutil.copyfile)
    by_content = encode([copy, "-o", out, "--model", ckpt, *BASE, "--hash"])
    assert by_content.exit_code == 0 and json.loads(by_content.stdout)["encoded"] == 0
    assert torch.equal(gemma4enc.open(out)[copy / "sub" / "p0.png"], before[os.path.join("sub", "p0.png")])
