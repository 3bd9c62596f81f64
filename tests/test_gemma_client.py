"""The tokens' real client: a full Gemma 4 generates the same from the shards as from the pixels.

Tiny random E2B-like (per-layer inputs) and 26B-like (vision tokens attend both ways) models;
two images and a short clip, once through Gemma4Processor with pixel values, once with the
tokens of a `gemma4enc encode` output folder. Random models say garbage, but the same garbage.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import gemma4enc

from . import gemma_client as gc
from .gemma_client import FRAMES, IMAGE_TOKENS, PATHS, TEXT, encode

GREEDY = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return gc.write_media(tmp_path_factory.mktemp("client-media"))


@pytest.fixture(scope="module", params=["e2b", "26b"])
def client(request, media, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(f"client-{kind}")
    ckpt = gc.build(folder / "ckpt", kind, seed=3)
    emb = encode(media, folder / "out", ckpt, "--dtype", "float32", "--out-dtype", "float32")
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    processor = gc.processor(IMAGE_TOKENS)
    paths = [media / name for name in PATHS]
    inputs = emb.mm_encoder_outputs(paths, model=model)
    return SimpleNamespace(kind=kind, folder=folder, ckpt=ckpt, emb=emb, model=model, processor=processor,
                           pixels=gc.pixel_inputs(processor, media), paths=paths, inputs=inputs,
                           batch=inputs.tokenize(processor, TEXT))


@torch.no_grad()
def logits(model, batch):
    return model(**batch).logits[0].float()


def close(got, want, rel=1e-4):
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= rel * scale, f"max diff {diff:.3g} > {rel} × scale {scale:.3g}"
    return diff / scale


def new_tokens(model, batch):
    out = model.generate(**batch, **GREEDY)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def test_the_prompt_is_the_processors(client):
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        assert torch.equal(client.batch[key], client.pixels[key]), key
    image, other, video = client.inputs.media
    assert image.frame_tokens == [client.pixels["image_position_ids"][0].ne(-1).all(-1).sum().item() // 9]
    assert video.kind == "video" and len(video.frame_tokens) == FRAMES and len(set(video.frame_tokens)) == 1
    assert [gemma4enc.output.gemma.mmss(t) for t in video.timestamps] == ["00:00", "00:00", "00:00", "00:01"]
    text = client.inputs.prompt(TEXT)[0]
    assert text.count("<|video|>") == sum(video.frame_tokens) and "00:01 <|image><|video|>" in text


def test_generation_from_the_shards_equals_generation_from_the_pixels(client):
    model, pixels, batch = client.model, client.pixels, client.batch
    assert set(batch["mm_encoder_outputs"]) == {"image", "video"}
    assert len(batch["mm_encoder_outputs"]["video"].pooler_output) == FRAMES  # one tensor per frame
    close(logits(model, batch), logits(model, pixels))
    want = new_tokens(model, pixels)
    assert len(set(want)) > 5  # not a model that repeats one token whatever it is shown
    assert new_tokens(model, batch) == want


def test_wrong_tokens_change_the_output(client):
    """What the equality above would catch: frames out of order, or attention of the wrong kind."""
    model, batch = client.model, client.batch
    want = logits(model, client.pixels)
    frames = batch["mm_encoder_outputs"]["video"].pooler_output
    swapped = dict(batch["mm_encoder_outputs"], video=gemma4enc.output.gemma.encoder_output(frames[::-1]))
    with pytest.raises(AssertionError):
        close(logits(model, batch | {"mm_encoder_outputs": swapped}), want, rel=1e-2)
    causal = logits(model, {k: v for k, v in batch.items() if k != "mm_token_type_ids"})
    if client.kind == "26b":  # use_bidirectional_attention="vision": without the type ids, image tokens go causal
        with pytest.raises(AssertionError):
            close(causal, want, rel=1e-2)
    else:
        close(causal, want)


@torch.no_grad()
def greedy(model, spliced, steps):
    """generate() in 5.24 refuses inputs_embeds for Gemma 4: prefill from them, then decode."""
    out = model(**spliced, use_cache=True)
    mask, tokens = spliced["attention_mask"], []
    for _ in range(steps):
        tokens.append(out.logits[:, -1:].argmax(-1))
        mask = torch.cat([mask, mask.new_ones(1, 1)], 1)
        named = "cache" if hasattr(out, "cache") else "past_key_values"  # renamed in 5.24
        out = model(input_ids=tokens[-1], attention_mask=mask, use_cache=True, **{named: getattr(out, named)})
    return torch.cat(tokens, 1)[0].tolist()


def test_manual_splice_for_versions_without_mm_encoder_outputs(client):
    model, spliced = client.model, client.inputs.splice(client.model, client.batch)
    assert "input_ids" not in spliced and "mm_encoder_outputs" not in spliced
    assert ("per_layer_inputs" in spliced) == (client.kind == "e2b")
    close(logits(model, spliced), logits(model, client.pixels))
    assert greedy(model, spliced, 20) == new_tokens(model, client.pixels)
    if client.kind == "e2b":  # without them the model must read ids back from embeddings that hold soft tokens
        with pytest.raises(RuntimeError, match="do not exactly match"):
            logits(model, {k: v for k, v in spliced.items() if k != "per_layer_inputs"})


def test_device_dtype_and_clear_errors(client, media):
    emb, model = client.emb, client.model
    half = emb.mm_encoder_outputs(client.paths, dtype=torch.bfloat16, device="meta")
    tensors = [t for o in half.mm_encoder_outputs.values() for t in o.pooler_output]
    assert len(tensors) == 2 + FRAMES and all(t.dtype == torch.bfloat16 and t.is_meta for t in tensors)
    with pytest.raises(KeyError, match="not in"):
        emb.mm_encoder_outputs([media / "nowhere.png"])
    with pytest.raises(KeyError, match="broken.jpg: status"):
        emb.mm_encoder_outputs([media / "broken.jpg"])
    other = gc.build(client.folder / "other", client.kind, seed=4)
    from transformers import Gemma4ForConditionalGeneration

    for wrong in (str(other), Gemma4ForConditionalGeneration.from_pretrained(other)):
        with pytest.raises(ValueError, match="made with"):
            emb.mm_encoder_outputs(client.paths, model=wrong)
    wider = gc.config(client.kind)
    wider.text_config.hidden_size = 64
    with pytest.raises(ValueError, match="48 wide .* 64 wide"):
        emb.mm_encoder_outputs(client.paths, model=wider)
    emb.mm_encoder_outputs(client.paths, model=str(client.ckpt))  # the same checkpoint, named as it was
    with pytest.raises(ValueError, match="2 <\\|image\\|> but 1 image"):
        emb.mm_encoder_outputs(client.paths[1:]).tokenize(client.processor, TEXT)
    frames = sum(client.inputs.media[2].frame_tokens)
    with pytest.raises(ValueError, match=f"{frames} video placeholders in input_ids, 0 stored"):
        emb.mm_encoder_outputs(client.paths[:2]).splice(model, client.batch)
