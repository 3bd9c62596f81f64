"""`gemma4enc demo`'s checkpoint is one a person can fine-tune and serve offline: its tokenizer and
chat template load with no hub, every id it writes is inside the vocabulary, the language model
runs a training step on the demo's own tokens, and the fields vLLM reads are there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import RUN, app  # noqa: F401 - the CLI in this process

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}


@pytest.mark.slow
def test_demo_checkpoint_tokenizes_trains_and_is_servable(tmp_path):
    result = RUN.invoke(app, ["demo", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    ckpt = tmp_path / "demo" / "tiny-gemma4"
    config = json.loads((ckpt / "config.json").read_text())
    vocab_size = config["text_config"]["vocab_size"]
    for key in ("image_token_id", "video_token_id", "boi_token_id", "eoi_token_id", "audio_token_id"):
        assert 0 <= config[key] < vocab_size, key
    assert config["text_config"]["head_dim"] >= 32  # vLLM's CPU attention takes 32 and up
    assert config["vision_config"]["default_output_length"] == 280  # vLLM's gemma4_mm reads it
    assert json.loads((ckpt / "processor_config.json").read_text())["processor_class"] == "Gemma4Processor"

    # offline, in a process of its own: the tokenizer, its chat template, ids in the vocabulary
    code = f"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(ckpt)!r})
msgs = [{{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": "What is this?"}}]}}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False)["input_ids"]  # the template wrote <bos>
print(json.dumps({{"text": text, "ids": ids, "image": tok.convert_tokens_to_ids("<|image|>"), "unk": tok.unk_token_id}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["text"].endswith("<|turn>model\n") and "<|image|>" in got["text"]
    assert got["image"] == config["image_token_id"]
    assert got["unk"] not in got["ids"] and max(got["ids"]) < vocab_size

    # fine-tunable: the demo's own tokens spliced in, a loss, a gradient on the language model
    import gemma4enc
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    emb = gemma4enc.open(tmp_path / "demo" / "embeddings")
    photo = str(Path(tmp_path / "demo" / "media" / "photos" / "landscape.jpg").resolve())
    inputs = emb.mm_encoder_outputs([photo], model=model)
    batch = inputs.tokenize(tok, "What is in <|image|>?")
    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
