"""Real layouts (gemma4enc/layouts.py): tiny checkpoints rewritten with what published ones hold:
leftovers (skipped, same tokens), missing or unknown tensors (an error naming them), quantized
vision towers in each format (refused, exit 2, naming the format and the bf16 model)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from gemma4enc.dev import demo
from gemma4enc.errors import UsageError
from gemma4enc.media.patches import patchify
from gemma4enc.model import layouts
from gemma4enc.model.load import load_tower

from .helpers import encode as run_encode
from .helpers import encode_argv, flags, photo
from .helpers import shard_tokens as read_shards

FLAGS = flags(json=False, frames=None)


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory):
    """26B-like: use_clipped_linears false, standardize, one file."""
    folder = tmp_path_factory.mktemp("ckpt-unclipped")
    demo.build(folder, seed=3, clipped=False, standardize=True)
    return folder


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-media")
    photo(300, 420, seed=5).save(root / "a.png")
    photo(500, 260, seed=6).save(root / "b.jpg")
    return root


def rewrite(src, dst, edit, config_edit=None):
    """Copy a one-file checkpoint and rewrite its tensors (and config) the way a publisher did."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def vision_linears(tensors):
    return [k for k in tensors if k.startswith("model.vision_tower.") and k.endswith("_proj.linear.weight")]


def tokens(folder):
    tower = load_tower(str(folder), "float32", "cpu")
    return tower.encode([patchify(photo(300, 420, seed=5), 280), patchify(photo(500, 260, seed=6), 280)], pack=True)


def encode(media, out, model):
    return run_encode([media, "-o", out, "--model", model, *FLAGS])


def shard_tokens(out):
    return {os.path.basename(path): t for path, t in read_shards(out)[1].items()}


# ---- leftovers ----------------------------------------------------------------------------

def add_gemma3n_leftovers(t):
    t["model.embed_vision.embedding.weight"] = torch.randn(128, 32).to(torch.bfloat16)
    t["model.embed_vision.hard_embedding_norm.weight"] = torch.randn(32)
    t["model.embed_vision.soft_embedding_norm.weight"] = torch.randn(32)


def add_clip_scalars(t):
    for key in vision_linears(t):
        base = key.removesuffix(".weight").removesuffix(".linear")
        for s in ("input_min", "input_max", "output_min", "output_max"):
            t[f"{base}.{s}"] = torch.tensor(-1.0 if s.endswith("min") else 1.0, dtype=torch.bfloat16)


def test_gemma3n_leftovers_are_skipped_with_one_line_and_change_nothing(ckpt, tmp_path, caplog, media):
    dirty = rewrite(ckpt, tmp_path / "dirty", add_gemma3n_leftovers)
    with caplog.at_level(logging.WARNING, logger="gemma4enc.model.layouts"):
        got = tokens(dirty)
    lines = [r.getMessage() for r in caplog.records if r.name == "gemma4enc.model.layouts"]
    assert len(lines) == 1, lines
    assert "skipped 3 tensor(s)" in lines[0] and "Gemma 3n-era" in lines[0]
    assert "model.embed_vision.embedding.weight" in lines[0]
    for a, b in zip(got, tokens(ckpt)):
        assert torch.equal(a, b)
    # through the CLI too: the same shards' tokens as the clean checkpoint
    assert encode(media, tmp_path / "out-dirty", dirty).exit_code == 0
    assert encode(media, tmp_path / "out-clean", ckpt).exit_code == 0
    mine, clean = shard_tokens(tmp_path / "out-dirty"), shard_tokens(tmp_path / "out-clean")
    assert mine.keys() == clean.keys() == {"a.png", "b.jpg"}
    assert all(torch.equal(mine[k], clean[k]) for k in clean)


def test_clip_scalars_unused_by_the_config_are_skipped(unclipped, tmp_path, caplog):
    dirty = rewrite(unclipped, tmp_path / "clips", add_clip_scalars)
    n = 4 * 7 * 2  # 4 scalars × 7 linears × 2 layers
    with caplog.at_level(logging.WARNING, logger="gemma4enc.model.layouts"):
        got = tokens(dirty)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gemma4enc.model.layouts"]
    assert f"skipped {n} tensor(s)" in line and "use_clipped_linears: false" in line and f"and {n - 3} more" in line
    for a, b in zip(got, tokens(unclipped)):
        assert torch.equal(a, b)


def test_clip_scalars_are_needed_where_the_config_clips(ckpt, tmp_path):
    """The same names are not leftovers when the config uses them: one dropped is a missing tensor."""
    def drop(t):
        del t["model.vision_tower.encoder.layers.1.mlp.down_proj.output_max"]

    bad = rewrite(ckpt, tmp_path / "noclip", drop)
    with pytest.raises(UsageError, match=r"lacks 1 vision_tower\.\* tensor\(s\) the config needs: "
                                         r"model\.vision_tower\.encoder\.layers\.1\.mlp\.down_proj\.output_max$"):
        load_tower(str(bad), "float32", "cpu")


# ---- missing and unknown tensors ----------------------------------------------------------

def test_missing_tensors_name_the_first_three_and_how_many_more(ckpt, tmp_path):
    def drop(t):
        for key in sorted(k for k in t if k.startswith("model.vision_tower.encoder.layers.0.self_attn."))[:5]:
            del t[key]

    bad = rewrite(ckpt, tmp_path / "missing", drop)
    with pytest.raises(UsageError) as e:
        load_tower(str(bad), "float32", "cpu")
    message = str(e.value)
    assert "lacks 5 vision_tower.* tensor(s)" in message and message.endswith("and 2 more")
    assert message.count("model.vision_tower.encoder.layers.0.self_attn.") == 3


GONE = "model.vision_tower.encoder.layers.1.post_feedforward_layernorm.weight"


def test_missing_tensor_exits_2_with_one_line(ckpt, tmp_path, media):
    bad = rewrite(ckpt, tmp_path / "missing", lambda t: t.pop(GONE))
    r = subprocess.run(encode_argv(media, "-o", tmp_path / "out", "--model", bad, *FLAGS), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("gemma4enc: error:") and GONE in line
    assert not (tmp_path / "out").exists()


def test_an_unknown_tensor_is_an_error(ckpt, tmp_path):
    bad = rewrite(ckpt, tmp_path / "extra", lambda t: t.update({"model.vision_tower.encoder.layers.2.x.weight":
                                                                torch.zeros(2)}))
    with pytest.raises(UsageError, match=r"1 vision_tower\.\* tensor\(s\) that the config's modules do not have"):
        load_tower(str(bad), "float32", "cpu")


# ---- quantized vision towers --------------------------------------------------------------

def bnb_4bit(t):
    for key in vision_linears(t):
        w = t.pop(key)
        t[key] = torch.randint(0, 255, (w.numel() // 2, 1), dtype=torch.uint8)
        t[key + ".absmax"] = torch.rand(w.numel() // 64)
        t[key + ".quant_map"] = torch.rand(16)
        t[key + ".quant_state.bitsandbytes__nf4"] = torch.zeros(40, dtype=torch.uint8)


def compressed_nvfp4(t):
    for key in vision_linears(t):
        w = t.pop(key)
        stem = key.removesuffix(".weight")
        t[stem + ".weight_packed"] = torch.randint(0, 255, (w.shape[0], w.shape[1] // 2), dtype=torch.uint8)
        t[stem + ".weight_scale"] = torch.rand(w.shape[0], max(w.shape[1] // 16, 1)).to(torch.float8_e4m3fn)
        t[stem + ".weight_global_scale"] = torch.rand(1)


def modelopt_nvfp4(t):
    for key in vision_linears(t):
        w = t.pop(key)
        t[key] = torch.randint(0, 255, (w.shape[0], w.shape[1] // 2), dtype=torch.uint8)
        t[key.replace(".weight", ".weight_scale")] = torch.rand(w.shape[0], 2).to(torch.float8_e4m3fn)
        t[key.replace(".weight", ".weight_scale_2")] = torch.rand(())
        t[key.replace(".weight", ".input_scale")] = torch.rand(())


def mlx_affine(t):
    """mlx-vlm: no 'model.' prefix, uint32 packed weights with per-group scales and biases."""
    for key in list(t):
        t[key.removeprefix("model.")] = t.pop(key)
    for key in [k for k in t if k.startswith("vision_tower.") and k.endswith("_proj.linear.weight")]:
        w = t.pop(key)
        t[key] = torch.randint(0, 2**31 - 1, (w.shape[0], w.shape[1] // 8), dtype=torch.int32).view(torch.uint32)
        t[key.replace(".weight", ".scales")] = torch.rand(w.shape[0], 1).to(torch.bfloat16)
        t[key.replace(".weight", ".biases")] = torch.rand(w.shape[0], 1).to(torch.bfloat16)


def int8_weights(t):
    key = vision_linears(t)[0]
    t[key] = t[key].to(torch.int8)


@pytest.mark.parametrize("edit, config, fmt", [
    (bnb_4bit, {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                        "bnb_4bit_quant_type": "nf4", "llm_int8_skip_modules": None}},
     "bitsandbytes 4-bit"),
    (bnb_4bit, {}, "bitsandbytes 4-bit"),  # the keys alone tell
    (compressed_nvfp4, {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                                "config_groups": {"group_0": {"targets": ["Linear"]}},
                                                "ignore": ["lm_head"]}},
     "compressed-tensors nvfp4-pack-quantized"),
    (compressed_nvfp4, {}, "compressed-tensors"),
    (modelopt_nvfp4, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "ModelOpt NVFP4"),
    (mlx_affine, {"quantization": {"group_size": 64, "bits": 4}}, "MLX affine 4-bit"),
    (mlx_affine, {}, "MLX affine"),
    (lambda t: None, {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "bitsandbytes 4-bit; config.json's quantization settings cover the vision tower"),
    (int8_weights, {}, "int8 weights; tensor vision_tower.encoder.layers.0"),
])
def test_quantized_towers_are_refused_naming_the_format(ckpt, tmp_path, edit, config, fmt):
    bad = rewrite(ckpt, tmp_path / "quant", edit, lambda c: c.update(config))
    with pytest.raises(UsageError) as e:
        load_tower(str(bad), "float32", "cpu")
    message = str(e.value)
    assert f"the vision tower is quantized ({fmt}" in message, message
    assert "use the bf16 checkpoint of the same model, e.g. google/gemma-4-E2B-it" in message


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*vision_tower.*",
                                                                                  "re:.*embed_vision.*"]},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["re:.*language_model.*"]}}},
    {"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": ["vision_tower", "embed_vision",
                                                                                    "lm_head"]},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["model.vision_tower*", "model.embed_vision*"]},
])
def test_a_quantized_language_model_beside_a_bf16_tower_loads(ckpt, tmp_path, quantization_config):
    ok = rewrite(ckpt, tmp_path / "lm-quant", lambda t: None, lambda c: c.update(quantization_config=quantization_config))
    for a, b in zip(tokens(ok), tokens(ckpt)):
        assert torch.equal(a, b)


def test_a_quantized_tower_exits_2_with_one_line_through_the_cli(ckpt, tmp_path, media):
    bad = rewrite(ckpt, tmp_path / "gemma-4-31B-it-nvfp4", modelopt_nvfp4,
                  lambda c: c.update(quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"}))
    result = encode(media, tmp_path / "out", bad)
    assert result.exit_code == 2
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert line.startswith("gemma4enc: error:") and "quantized (ModelOpt NVFP4" in line
    assert not (tmp_path / "out").exists()


def test_the_bf16_model_to_use_is_named_by_size():
    from types import SimpleNamespace as NS

    def named(name, text_hidden):
        return layouts._bf16_id(name, NS(text_config=NS(hidden_size=text_hidden)))

    assert named("acme/gemma-4-31B-it-NVFP4", 5376) == "google/gemma-4-31B-it"
    assert named("acme/gemma-4-26B-A4B-it-bnb-4bit", 2816) == "google/gemma-4-26B-A4B-it"
    assert named("acme/gemma-4-e4b-nf4", 2560) == "google/gemma-4-E4B"  # a base model stays base
    assert named("/models/local-q4", 1536) == "google/gemma-4-E2B-it"
    assert named("/models/local-q4", 48) == "e.g. google/gemma-4-E2B-it"
