"""Fine-tuning from the shards is fine-tuning from the pixels: the same loss, gradients and steps.

Tiny random full Gemma 4 models, E2B-like (per-layer inputs) and 26B-like (vision tokens attend
both ways); a few conversations over two photos and a clip, once through Gemma4Processor with
the pixels and a frozen tower, once through training.Collator with the float32 tokens of a
`gemma4enc encode` output folder.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gemma4enc import training
from gemma4enc.output import gemma

from . import gemma_client as gc
from .gemma_client import FRAMES, IMAGE_TOKENS, encode

TURN, END = "<|turn>model\n", "<turn|>\n"


def conversations(media):
    a, b, clip = (str(media / n) for n in gc.PATHS)
    turned = str(media / "turned.jpg")
    return [
        {"messages": [
            {"role": "user", "content": [{"type": "image", "path": a}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A red cat."}]},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes, sure."}]},
        {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "path": b},
                                         {"type": "image", "path": turned}]},
            {"role": "assistant", "content": "The left one is taller."}]},
        {"messages": [
            {"role": "system", "content": "Be short."},
            {"role": "user", "content": [{"type": "video", "path": clip}, {"type": "text", "text": "And here?"},
                                         {"type": "image", "path": b}]},
            {"role": "assistant", "content": "It moves."}]},
    ]


def pixel_labels(tokenizer, ids, attention):
    """Labels found another way than the collator's: by token ids, from each `<|turn>model\\n`
    to the end of its turn."""
    turn, end = (tokenizer(s, add_special_tokens=False)["input_ids"] for s in (TURN, END))
    labels = torch.full_like(ids, training.IGNORE)
    for row, (seq, mask) in enumerate(zip(ids.tolist(), attention.tolist())):
        i, inside = 0, False
        while i < len(seq):
            if not inside and seq[i:i + len(turn)] == turn:
                i, inside = i + len(turn), True
                continue
            if inside and seq[i:i + len(end)] == end:
                labels[row, i:i + len(end)] = ids[row, i:i + len(end)]
                i, inside = i + len(end), False
                continue
            if inside and mask[i]:
                labels[row, i] = ids[row, i]
            i += 1
    return labels


class PixelCollator:
    """What a transformers user writes: the chat template, then Gemma4Processor on the photos as
    transformers loads them (load_image: EXIF orientation applied, RGB) and the sampled frames."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, examples):
        from transformers.image_utils import load_image

        texts = [self.processor.apply_chat_template(e["messages"], tokenize=False) for e in examples]
        parts = [training.media_parts(e["messages"]) for e in examples]
        images = [[load_image(p["path"]) for p in ps if p["type"] == "image"] for ps in parts]
        clips = [gc.video_frames(p["path"], FRAMES) for ps in parts for p in ps if p["type"] == "video"]
        extra = {"videos": [c[0] for c in clips], "video_metadata": [c[1] for c in clips]} if clips else {}
        batch = dict(self.processor(text=texts, images=images, add_special_tokens=False, padding=True,
                                    return_tensors="pt", **extra))
        batch.pop("num_soft_tokens_per_image", None)
        batch.pop("num_soft_tokens_per_video", None)
        batch["labels"] = pixel_labels(self.processor.tokenizer, batch["input_ids"], batch["attention_mask"])
        return batch


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """gemma_client's media and a photo stored turned (EXIF orientation 6), as phones save them."""
    from gemma4enc.dev.camera import save_photo

    from .helpers import photo

    root = gc.write_media(tmp_path_factory.mktemp("train-media"))
    save_photo(photo(240, 420, seed=3), root / "turned.jpg", orientation=6, quality=95)
    return root


def load(ckpt):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    training.freeze_vision(model)
    return model


@pytest.fixture(scope="module", params=["e2b", "26b"])
def setup(request, media, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(f"train-{kind}")
    ckpt = gc.build(folder / "ckpt", kind, seed=7)
    emb = encode(media, folder / "out", ckpt, "--dtype", "float32", "--out-dtype", "float32", "--resize", "exact")
    model = load(ckpt)
    processor = gc.processor(IMAGE_TOKENS)
    examples = conversations(media)
    data = training.Conversations(emb, examples, model=model)
    collate = training.Collator(processor, model=model)
    return SimpleNamespace(kind=kind, folder=folder, ckpt=ckpt, emb=emb, model=model, processor=processor,
                           examples=examples, data=data, collate=collate,
                           stored=collate([data[i] for i in range(len(data))]),
                           pixels=PixelCollator(processor)(data.examples))


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_the_batch_is_the_processors(setup):
    stored, pixels = setup.stored, setup.pixels
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "labels"):
        assert torch.equal(stored[key], pixels[key]), key
    types, labels = stored["mm_token_type_ids"], stored["labels"]
    assert (types == 1).any() and (types == 2).any() and (labels[types != 0] == training.IGNORE).all()
    tokenizer = setup.processor.tokenizer
    trained = ["".join(tokenizer.convert_ids_to_tokens(row[row != training.IGNORE])) for row in labels]
    assert trained == [f"A red cat.{END}Yes, sure.{END}", f"The left one is taller.{END}", f"It moves.{END}"]
    videos = stored["mm_encoder_outputs"]["video"].pooler_output
    assert len(videos) == FRAMES and all(t.dtype == torch.float32 for t in videos)
    # image-only conversations: the same as the processor's own apply_chat_template with the files
    want = setup.processor.apply_chat_template([e["messages"] for e in setup.data.examples[:2]], tokenize=True,
                                               return_dict=True, padding=True, return_tensors="pt")
    for key in ("input_ids", "mm_token_type_ids"):
        assert torch.equal(setup.collate([setup.data[0], setup.data[1]])[key], want[key]), key


def test_loss_and_gradients_equal_the_pixels(setup):
    model = setup.model
    want_loss, want = loss_and_grads(model, setup.pixels)
    got_loss, got = loss_and_grads(model, setup.stored)
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss), (got_loss, want_loss)
    assert want and set(got) == set(want)
    assert not any(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in want)  # frozen
    worst = 0.0
    for name, g in want.items():
        scale = g.abs().max().item()
        assert scale > 0, f"{name}: no gradient"
        diff = (got[name] - g).abs().max().item()
        assert diff <= 1e-4 * scale, f"{name}: max diff {diff:.3g} > 1e-4 × {scale:.3g}"
        worst = max(worst, diff / scale)
    print(f"{setup.kind}: loss {got_loss:.6f} vs {want_loss:.6f}; worst gradient diff {worst:.2e} × scale")


def test_what_would_break_the_equality(setup):
    """A wrong soft-token count, a dropped mm_token_type_ids, an unmasked soft token."""
    model, stored = setup.model, setup.stored
    with torch.no_grad():
        want = model(**setup.pixels).loss.item()

        def loss(batch):
            return model(**batch).loss.item()

        def differs(batch):
            return abs(loss(batch) - want) > 1e-3 * abs(want)

        # one token fewer for the first photo, its prompt written for the tokens it has: another result
        item = setup.data[0]
        first = item["media"].mm_encoder_outputs["image"].pooler_output[0]
        m = item["media"].media[0]
        short = gemma.ModelInputs([gemma.Media(m.path, "image", [m.frame_tokens[0] - 1])],
                                  {"image": gemma.encoder_output([first[:-1]])})
        assert differs(setup.collate([{**item, "media": short}] + [setup.data[1], setup.data[2]]))
        # a prompt that says more tokens than there are: refused
        wrong = gemma.ModelInputs([gemma.Media(m.path, "image", [m.frame_tokens[0] + 1])],
                                  {"image": gemma.encoder_output([first])})
        with pytest.raises(Exception, match="do not match"):
            loss(setup.collate([{**item, "media": wrong}] + [setup.data[1], setup.data[2]]))
        # the type ids: vision tokens go causal without them on the 26B-like model, nothing changes on E2B
        untyped = {k: v for k, v in stored.items() if k != "mm_token_type_ids"}
        assert differs(untyped) == (setup.kind == "26b")
        # a soft token's id as a label: trained on, another loss
        labels = stored["labels"].clone()
        soft = (stored["mm_token_type_ids"] != 0).nonzero()[0]
        labels[tuple(soft)] = stored["input_ids"][tuple(soft)]
        assert differs(stored | {"labels": labels})
        assert not differs(stored)


def run_trainer(ckpt, dataset, collate, out, optim, steps=3):
    from transformers import Trainer, TrainingArguments

    model = load(ckpt)
    args = TrainingArguments(out, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3, seed=0,
                             optim=optim, remove_unused_columns=False, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.state.global_step


def vision(name: str) -> bool:
    return name.startswith(("model.vision_tower.", "model.embed_vision."))


@pytest.mark.slow
def test_three_trainer_steps_give_the_same_weights(setup, tmp_path):
    """SGD: the steps agree as the gradients do. Adam divides each gradient by its own running size,
    so where a gradient lies near zero (beside eps = 1e-8) a difference of 1e-9, well inside the
    gradients' agreement, moves that weight by up to a step: Adam's steps agree on the whole."""
    start = {n: p.detach() for n, p in load(setup.ckpt).named_parameters()}
    for optim in ("sgd", "adamw_torch"):
        stored, steps = run_trainer(setup.ckpt, setup.data, setup.collate, tmp_path / f"s-{optim}", optim)
        pixels, _ = run_trainer(setup.ckpt, setup.data.examples, PixelCollator(setup.processor),
                                tmp_path / f"p-{optim}", optim)
        assert steps == 3
        moved, worst, total, off = 0, 0.0, 0.0, 0.0
        for name, want in pixels.items():
            step = (want - start[name]).abs()
            diff = (stored[name] - want).abs()
            if vision(name):
                assert step.max() == 0 and diff.max() == 0, name
                continue
            assert step.max() > 0, f"{name} did not move"
            # and the float32 rounding of the weights themselves: one ulp of a weight of 0.5 is 6e-8
            rounding = 2 * torch.finfo(torch.float32).eps * want.abs().max().item()
            excess = max(diff.max().item() - rounding, 0.0)
            if optim == "sgd":
                assert excess <= 1e-4 * step.max().item(), f"{name}: max diff {diff.max():.3g}, steps {step.max():.3g}"
            worst, moved = max(worst, excess / step.max().item()), moved + 1
            total, off = total + step.sum().item(), off + diff.sum().item()
        assert moved > 10
        if optim != "sgd":
            assert off <= 1e-3 * total, f"Adam: the weights moved {total:.4g} in all, {off:.3g} apart"
        print(f"{setup.kind} {optim}: {moved} tensors moved; worst weight diff {worst:.2e} × its steps, "
              f"in all {off / total:.2e} of the steps")


def test_a_long_clips_stored_frames_are_transformers_own_video_path(setup, tmp_path):
    """8 frames of a 120-frame H.264 clip (issue 46: one such frame parted from transformers' video
    path by 7.1e-3 on an AMX machine): the tokens gemma4enc stores for each frame are the model's
    get_video_features of the frames transformers' load_video(backend="pyav") samples, within
    1e-4 of their scale (float32), frame by frame and in the same order."""
    from typer.testing import CliRunner

    import gemma4enc
    from gemma4enc.commands.cli import app
    from gemma4enc.dev.demo import write_video

    media = tmp_path / "long"
    media.mkdir()
    write_video(media / "long.mp4", frames=120)
    args = ["encode", str(media), "-o", str(tmp_path / "out"), "--model", str(setup.ckpt), "--device", "cpu",
            "--workers", "0", "--frames", "8", "--video-backend", "pyav", "--dtype", "float32",
            "--out-dtype", "float32", "--resize", "exact", "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    path = str(media / "long.mp4")
    emb = gemma4enc.open(tmp_path / "out")
    frames, meta = gc.video_frames(media / "long.mp4", 8)
    assert emb.row(path)["frame_indices"] == [int(i) for i in meta.frames_indices] == list(range(0, 120, 15))
    batch = setup.processor(text="<|video|>", videos=[frames], video_metadata=[meta], return_tensors="pt")
    with torch.no_grad():
        want = setup.model.model.get_video_features(
            batch["pixel_values_videos"], batch["video_position_ids"],
            num_frames_per_video=torch.tensor([len(frames)])).pooler_output[0]
    got = emb.frames(path)
    assert len(got) == 8 and sum(len(f) for f in got) == len(want)
    scale, at = want.abs().max(), 0
    for k, tokens in enumerate(got):
        part = want[at:at + len(tokens)]
        at += len(tokens)
        assert (tokens - part).abs().max() <= 1e-4 * scale, f"frame {k} (index {15 * k})"


def test_the_whole_file_is_checked_first(setup, media, tmp_path):
    rows = conversations(media) + [
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "nowhere.png"}]},
                      {"role": "assistant", "content": "?"}]},
        [{"role": "user", "content": [{"type": "image", "path": "broken.jpg"}, {"type": "image", "path": "a.png"}]},
         {"role": "assistant", "content": "?"}],
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "clip.mp4"}]},
                      {"role": "assistant", "content": "?"}]},
    ]
    jsonl = media / "train.jsonl"  # relative paths are below the file's folder
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(training.TrainingDataError) as e:
        training.Conversations(setup.emb, jsonl)
    message = str(e.value)
    assert message.startswith("6 examples, 9 media parts: 1 not in the OUT (")
    assert f"{media / 'nowhere.png'}" in message and "1 failed (" in message and "broken.jpg: decode_error" in message
    assert "1 encoded with other settings (" in message and "clip.mp4: a video, the conversation says image" in message
    # the settings: what the model made them, and budgets pinned by the caller
    with pytest.raises(training.TrainingDataError, match=r"4 encoded with other settings .*made with"):
        training.Conversations(setup.emb, conversations(media), model=gc.build(tmp_path / "other", setup.kind, 9))
    with pytest.raises(training.TrainingDataError, match="image_soft_tokens '140', want '280'"):
        training.Conversations(setup.emb, conversations(media), expect={"image_soft_tokens": 280})
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'image_tokens'.*image_soft_tokens"):
        training.Conversations(setup.emb, conversations(media), expect={"image_tokens": 280})  # a typo
    if setup.kind == "e2b":  # an OUT of pooled vectors only is refused up front, by OUT or by reader
        pooled = encode(media, tmp_path / "pooled", setup.ckpt, "--store", "pooled")
        for out in (pooled, tmp_path / "pooled"):
            with pytest.raises(training.TrainingDataError, match="--store pooled: it keeps each file's pooled"):
                training.Conversations(out, conversations(media))
        (tmp_path / "pooled" / "settings.json").unlink()  # nothing to tell by but the shards
        with pytest.raises(training.TrainingDataError, match=r"only its pooled vector is stored"):
            training.Conversations(tmp_path / "pooled", conversations(media))
    (media / "bad.jsonl").write_text('{"messages": []}\nnot json\n')
    with pytest.raises(training.TrainingDataError, match=r"bad.jsonl:2: not JSON"):
        training.Conversations(setup.emb, media / "bad.jsonl")
    good = training.Conversations(setup.emb, conversations(media), model=str(setup.ckpt))
    assert good.report.summary() == "3 examples, 5 media parts: every one has tokens in the OUT"


def test_the_recipe_runs_as_written(tmp_path, monkeypatch):
    """docs/training.md's code, against a tiny checkpoint at the hub id it names (a local folder
    shadows it) and an OUT encoded with the defaults (bfloat16 tokens)."""
    import re
    from pathlib import Path

    from typer.testing import CliRunner

    from gemma4enc.commands.cli import app
    from gemma4enc.dev.demo import write_video

    from .helpers import photo

    doc = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    found = re.search(r"<!-- tested: training -->\n```python\n(.*?)\n```", doc, re.S)
    assert found, "no '<!-- tested: training -->' code block in docs/training.md"
    monkeypatch.chdir(tmp_path)
    ckpt = gc.build(tmp_path / "google" / "gemma-4-E2B-it", "e2b", seed=5)
    (tmp_path / "media").mkdir()
    photo(240, 320, seed=1).save(tmp_path / "media" / "cat.jpg")
    write_video(tmp_path / "media" / "clip.mp4", frames=24)
    result = CliRunner().invoke(app, ["encode", "media", "-o", "embeddings", "--model", "google/gemma-4-E2B-it",
                                      "--device", "cpu", "--workers", "0", "--frames", "3", "-q"])
    assert result.exit_code == 0, result.output
    lines = [line for line in doc.splitlines() if line.startswith('{"messages"')]
    assert len(lines) == 2  # the file format's example, as the doc shows it
    (tmp_path / "train.jsonl").write_text("\n".join(lines * 2) + "\n")
    ns: dict = {}
    exec(compile(found.group(1), "docs/training.md:training", "exec"), ns)
    trainer, model = ns["trainer"], ns["model"]
    assert trainer.state.global_step == 2 and model.dtype == torch.bfloat16
    before = load(ckpt).to(torch.bfloat16).state_dict()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(after[k], before[k]) for k in after if vision(k))
    assert sum(not torch.equal(after[k], before[k]) for k in after if not vision(k)) > 10
    # TRL's SFTTrainer, continuing it
    pytest.importorskip("trl")  # in the test extra; the optional way, so not a requirement
    found = re.search(r"<!-- tested: trl -->\n```python\n(.*?)\n```", doc, re.S)
    assert found, "no '<!-- tested: trl -->' code block in docs/training.md"
    exec(compile(found.group(1), "docs/training.md:trl", "exec"), ns)
    assert ns["sft"].state.global_step == 2
    assert any(not torch.equal(v, after[k]) for k, v in model.state_dict().items() if not vision(k))


def run_sft(ckpt, rows, collate, out):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = load(ckpt)
    # bf16=False: SFTConfig turns autocast on by default, which would run the pixel path's tower in bfloat16
    args = SFTConfig(out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3, seed=0, optim="sgd",
                     bf16=False, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
                     report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=collate.processor.tokenizer, data_collator=collate(model))
    trainer.train()
    assert trainer.state.global_step == 3
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trl_sft_trainer_with_the_collator(setup, tmp_path):
    """TRL's SFTTrainer takes a datasets.Dataset of the (checked) conversations and the collator,
    which reads their media from the OUT: its steps are the ones it takes from the pixels."""
    pytest.importorskip("trl")  # in the test extra; the optional way, so not a requirement

    rows = [{"messages": [{**m, "content": m["content"] if isinstance(m["content"], list)
                           else [{"type": "text", "text": m["content"]}]} for m in e["messages"]]}
            for e in setup.data.examples]  # Arrow wants one type per column: content as parts everywhere
    processor = setup.processor

    class Stored:
        def __init__(self):
            self.processor = processor

        def __call__(self, model):
            return training.Collator(processor, model=model, out=setup.emb)

    class Pixels(Stored):
        def __call__(self, model):
            return PixelCollator(processor)

    stored = run_sft(setup.ckpt, rows, Stored(), tmp_path / "s")
    pixels = run_sft(setup.ckpt, rows, Pixels(), tmp_path / "p")
    start = {n: p.detach() for n, p in load(setup.ckpt).named_parameters()}
    moved = 0
    for name, want in pixels.items():
        step = (want - start[name]).abs().max().item()
        rounding = 2 * torch.finfo(torch.float32).eps * want.abs().max().item()
        assert (stored[name] - want).abs().max().item() <= 1e-4 * step + rounding, name
        moved += step > 0
    assert moved > 10


def test_dataset_and_collator_travel_to_worker_processes(setup):
    """A DataLoader whose workers spawn pickles both: the reader's open manifest is opened afresh."""
    import pickle

    data = pickle.loads(pickle.dumps(setup.data))
    collate = pickle.loads(pickle.dumps(training.Collator(setup.processor.tokenizer, device="cpu")))
    want = setup.collate([setup.data[i] for i in range(len(setup.data))])
    got = collate([data[i] for i in range(len(data))])
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "labels"):
        assert torch.equal(got[key], want[key]), key
    for kind, output in want["mm_encoder_outputs"].items():
        assert all(torch.equal(a, b) for a, b in zip(got["mm_encoder_outputs"][kind].pooler_output,
                                                     output.pooler_output)), kind
