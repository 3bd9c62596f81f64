"""Loading: local single-file and sharded, hub cache offline, vision tensors only, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gemma4enc.errors import UsageError
from gemma4enc.model import checkpoint as model_mod
from gemma4enc.model.load import load_tower

from .helpers import reference


def test_loads_exactly_the_vision_weights(ckpt_sharded, monkeypatch):
    opened, read = [], []
    real = model_mod.safe_open

    class Spy:
        def __init__(self, path, **kw):
            opened.append(os.path.basename(path))
            self.f = real(path, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(model_mod, "safe_open", Spy)
    tower = load_tower(str(ckpt_sharded), "float32", "cpu")
    index = json.loads((ckpt_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    vision_keys = {k for k in index if k.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert set(read) == vision_keys  # every vision tensor, and nothing else
    assert not any("language_model" in k for k in read)
    vision_files = {index[k] for k in vision_keys}
    assert set(opened) == vision_files and len(vision_files) < len(set(index.values()))
    # every loaded tensor equals transformers' own load
    ref = reference(ckpt_sharded).model
    mine = dict(tower.vision.state_dict()) | {f"embed.{k}": v for k, v in tower.embed.state_dict().items()}
    theirs = dict(ref.vision_tower.state_dict()) | {f"embed.{k}": v for k, v in ref.embed_vision.state_dict().items()}
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    assert tower.vision.std_bias.abs().sum() > 0  # the non-trivial buffers arrived


def test_bfloat16_keeps_rope_in_float32(ckpt):
    tower = load_tower(str(ckpt), "bfloat16", "cpu")
    assert tower.vision.patch_embedder.input_proj.weight.dtype == torch.bfloat16
    assert tower.vision.encoder.rotary_emb.inv_freq.dtype == torch.float32


def _fake_hub_cache(home, repo, src):
    snap = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    shutil.copytree(src, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    return snap


def _run(args, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "gemma4enc", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_hub_id_from_offline_cache(ckpt_sharded, tmp_path):
    home = tmp_path / "hf"
    _fake_hub_cache(home, "acme/tiny-gemma4", ckpt_sharded)
    code = ("from gemma4enc.model.load import load_tower; t = load_tower('acme/tiny-gemma4', 'float32', 'cpu');"
            "print(t.checkpoint.revision, t.out_dim)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["abc123", "48"]


def test_hub_id_not_cached_offline_is_a_clear_error(tmp_path):
    r = _run(["encode", str(tmp_path), "-o", str(tmp_path / "out"), "--model", "acme/missing"],
             {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert "acme/missing: not in the Hugging Face cache and HF_HUB_OFFLINE is set" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(model_type="llama"), "not a Gemma 4 checkpoint"),
    (lambda c: c.pop("vision_config"), "has no vision tower"),
])
def test_bad_checkpoints(ckpt, tmp_path, mutate, message):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    mutate(config)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=message):
        load_tower(str(bad), "float32", "cpu")


def test_checkpoint_without_vision_tensors(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "novision"
    shutil.copytree(ckpt, bad)
    tensors = {k: v for k, v in load_file(bad / "model.safetensors").items() if "vision_tower" not in k}
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(UsageError, match="no vision_tower"):
        load_tower(str(bad), "float32", "cpu")


@pytest.mark.parametrize("dtype, device, message", [
    ("float64", "cpu", "unknown dtype"),
    ("float32", "tpu", "device"),
    ("float32", "cuda:7", "CUDA"),
])
def test_bad_dtype_and_device(ckpt, dtype, device, message):
    with pytest.raises(UsageError, match=message):
        load_tower(str(ckpt), dtype, device)


def test_missing_folder_exits_2_with_one_line(tmp_path):
    r = _run(["encode", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path / "nope")], {})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("gemma4enc: error:")


def test_auto_dtype_is_bfloat16_where_the_device_multiplies_it_natively(tmp_path, monkeypatch):
    from gemma4enc.model import load as model

    with_amx = tmp_path / "amx"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n\n")
    without = tmp_path / "plain"
    without.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n")
    assert model.cpu_has_amx(str(with_amx)) and not model.cpu_has_amx(str(without))
    assert not model.cpu_has_amx(str(tmp_path / "absent"))  # not Linux: float32
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for has_amx, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(model, "cpu_has_amx", lambda: has_amx)
        assert model.dtype_name("auto", cpu) == want
        assert model.dtype_name("auto", cuda) == "bfloat16"
        assert model.dtype_name("float32", cpu) == "float32" and model.dtype_name("float16", cuda) == "float16"
