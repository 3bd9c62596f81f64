"""A tokenizer, chat template and processor config for the tiny random checkpoints that generate
(demo.build_servable: `gemma4enc demo`'s, one a person can fine-tune and serve offline):
character-level text, Gemma's specials and placeholders inside the vocabulary, a Gemma-4-like
chat template, the processor_config.json that Gemma4Processor would write."""

from __future__ import annotations

import json
import string

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
MM = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
      "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
VIDEO = "<|video|>"


def vocab() -> dict[str, int]:
    words = SPECIAL + list(MM.values()) + [VIDEO] + list(string.printable[:95]) + ["\n"]  # "\n" last: ids unchanged
    return {w: i for i, w in enumerate(words)}


# Gemma 4's turn format (`<|turn>role\n…<turn|>\n`, the assistant is `model`), each image / video
# part as the placeholder its processor expands; plain characters here, where Gemma's are tokens
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] | trim }}{% elif p['type'] == 'image' %}\n\n<|image|>\n\n"
    "{% elif p['type'] == 'video' %}\n\n<|video|>\n\n{% endif %}{% endfor %}{% endif %}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def tokenizer(newlines: bool = True):
    """Characters, Gemma's specials and placeholders, a Gemma-4-like chat template; a <bos>
    before every text, as Gemma's. newlines=False: split on "." as the first tests' tokenizer did,
    where a run of newlines is one <unk> (tests/gemma_client.py keeps it: its figures were made so)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    tk = Tokenizer(models.WordLevel(v, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]" if newlines else "."), "isolated")
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", v["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", extra_special_tokens={**MM, "video_token": VIDEO},
                                   chat_template=CHAT_TEMPLATE)


def processor_config(image_tokens: int = 280, video_tokens: int = 70) -> dict:
    """processor_config.json as Gemma4Processor.save_pretrained writes it, built without torchvision
    (which the video processor's class needs): the image processor's dict (the PIL class writes the
    torchvision class's name, and AutoProcessor builds whichever backend is installed), the video
    processor's settings that differ from nothing but say its budget, the audio feature extractor's."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return {
        "processor_class": "Gemma4Processor",
        "image_seq_length": image_tokens,
        "image_processor": Gemma4ImageProcessorPil(max_soft_tokens=image_tokens).to_dict(),
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "max_soft_tokens": video_tokens,
                            "patch_size": 16, "pooling_kernel_size": 3, "num_frames": 32,
                            "do_sample_frames": True},
        "feature_extractor": json.loads(Gemma4AudioFeatureExtractor().to_json_string()),  # numpy made JSON
    }
