"""Stored soft tokens → what a transformers Gemma 4 model takes in place of pixels.

transformers ≥ 5.18: `generate(input_ids, attention_mask, mm_token_type_ids, mm_encoder_outputs=…)`
with the processor's expanded prompt, which `ModelInputs.tokenize` writes from the stored token
counts and frame times. Older 5.x: `ModelInputs.splice` puts the tokens into the input embeddings
as `Gemma4Model.forward` does, with `per_layer_inputs` for the E2B/E4B models.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open


# Gemma 4's placeholders, as its processor writes them (its tokenizer's own, when it has them)
BOI, IMAGE, EOI, VIDEO = "<|image>", "<|image|>", "<image|>", "<|video|>"


def mmss(seconds: float) -> str:
    """A frame's time as Gemma4Processor writes it before the frame."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


@dataclass(frozen=True)
class Tokens:
    """The placeholder strings a tokenizer knows them by."""

    boi: str = BOI
    image: str = IMAGE
    eoi: str = EOI
    video: str = VIDEO

    @classmethod
    def of(cls, tokenizer) -> Tokens:
        return cls(
            *(
                getattr(tokenizer, name, None) or default
                for name, default in (("boi_token", BOI), ("image_token", IMAGE), ("eoi_token", EOI))
            )
        )


@dataclass(frozen=True)
class Media:
    """One file as the prompt must show it."""

    path: str
    kind: str  # "image" | "video"
    frame_tokens: list[int]  # soft tokens per frame (an image is one frame)
    timestamps: list[float] = field(
        default_factory=list
    )  # seconds per frame, as the processor counts them

    def placeholder(self, t: Tokens = Tokens()) -> str:
        """Gemma4Processor's replace_image_token / replace_video_token, from the stored counts."""
        if self.kind == "image":
            return f"{t.boi}{t.image * self.frame_tokens[0]}{t.eoi}"
        return " ".join(
            f"{mmss(s)} {t.boi}{t.video * n}{t.eoi}" for s, n in zip(self.timestamps, self.frame_tokens)
        )


def encoder_output(tensors: list[torch.Tensor]):
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    # a list of per-item tensors, as Gemma 4's own get_image_features hands its caller
    return BaseModelOutputWithPooling(pooler_output=tensors)  # type: ignore[arg-type]


@dataclass
class ModelInputs:
    """What `Embeddings.mm_encoder_outputs(paths)` returns: the tokens and what the prompt needs."""

    media: list[Media]
    # {"image": one (n_i, D) tensor per image, "video": one (n_f, D) tensor per frame}, in path order
    mm_encoder_outputs: dict

    def prompt(self, text: str | list[str], tokens: Tokens = Tokens()) -> list[str]:
        """Each image / video placeholder of `text`, in order, expanded for the next image / video."""
        texts = [text] if isinstance(text, str) else list(text)
        queues = {k: [m for m in self.media if m.kind == k] for k in ("image", "video")}
        found = {"image": 0, "video": 0}
        pattern = re.compile(f"{re.escape(tokens.image)}|{re.escape(tokens.video)}")

        def expand(match):
            kind = "image" if match.group() == tokens.image else "video"
            found[kind] += 1
            return (
                queues[kind][found[kind] - 1].placeholder(tokens)
                if found[kind] <= len(queues[kind])
                else ""
            )

        texts = [pattern.sub(expand, t) for t in texts]
        for kind, token in (("image", tokens.image), ("video", tokens.video)):
            if found[kind] != len(queues[kind]):
                raise ValueError(
                    f"the text has {found[kind]} {token} but {len(queues[kind])} {kind}(s) were read"
                )
        return texts

    def tokenize(self, processor, text: str | list[str]) -> dict:
        """`model.generate(**batch)` for transformers ≥ 5.18: ids, mask, mm_token_type_ids, mm_encoder_outputs.

        `processor` is a Gemma4Processor or its tokenizer; `text` is what you would give the
        processor, with one image placeholder per image and one video placeholder per video.
        """
        tokenizer = getattr(processor, "tokenizer", processor)
        return self.tokenize_expanded(tokenizer, self.prompt(text, Tokens.of(tokenizer)))

    def tokenize_expanded(self, tokenizer, texts: list[str], **kwargs) -> dict:
        """`tokenize` of texts whose placeholders `prompt` has already expanded; `kwargs` go to the
        tokenizer (training.py asks for `add_special_tokens` and the offsets)."""
        tokens = Tokens.of(tokenizer)
        if tokens.video not in tokenizer.get_added_vocab():
            tokenizer.add_special_tokens(
                {"additional_special_tokens": [tokens.video]}
            )  # as Gemma4Processor does
        batch = dict(tokenizer(texts, padding=True, return_tensors="pt", **kwargs))
        ids = batch["input_ids"]
        types = torch.zeros_like(ids)
        for kind, token, value in (("image", tokens.image, 1), ("video", tokens.video, 2)):
            mask = ids == tokenizer.convert_tokens_to_ids(token)
            want = sum(sum(m.frame_tokens) for m in self.media if m.kind == kind)
            if int(mask.sum()) != want:
                raise ValueError(
                    f"the tokenizer made {int(mask.sum())} {token} tokens of the prompt, "
                    f"the stored {kind} tokens are {want}: it does not keep {token} whole"
                )
            types[mask] = value
        return batch | {"mm_token_type_ids": types, "mm_encoder_outputs": self.mm_encoder_outputs}

    def splice(self, model, batch: dict) -> dict:
        """The same inputs for a forward pass on any transformers 5.x: `model(**inputs.splice(model, batch))`.

        As Gemma4Model.forward: placeholders become the pad token, are embedded, then replaced
        by the soft tokens; E2B/E4B also take per-layer inputs from the padded ids, which 5.9+
        accepts (without them, the model would try to read token ids back from the embeddings).
        5.24's `generate` refuses `inputs_embeds` for Gemma 4: prefill with this, decode from the cache.
        """
        config, ids = model.config, batch["input_ids"]
        placeholders = {"image": ids == config.image_token_id, "video": ids == config.video_token_id}
        text_ids = ids.masked_fill(
            placeholders["image"] | placeholders["video"], config.text_config.pad_token_id
        )
        embeds = model.get_input_embeddings()(text_ids.to(model.device))
        for kind, placeholder in placeholders.items():
            stored = (
                self.mm_encoder_outputs[kind].pooler_output if kind in self.mm_encoder_outputs else []
            )
            if int(placeholder.sum()) != sum(t.shape[0] for t in stored):
                raise ValueError(
                    f"{int(placeholder.sum())} {kind} placeholders in input_ids, "
                    f"{sum(t.shape[0] for t in stored)} stored {kind} tokens"
                )
            if stored:
                feats = torch.cat(stored).to(embeds.device, embeds.dtype)
                mask = placeholder.to(embeds.device)[..., None].expand_as(embeds)
                embeds = embeds.masked_scatter(mask, feats)
        out = {
            "inputs_embeds": embeds,
            "attention_mask": batch["attention_mask"],
            "mm_token_type_ids": batch["mm_token_type_ids"],
        }
        if config.get_text_config().hidden_size_per_layer_input:
            out["per_layer_inputs"] = model.model.language_model.get_per_layer_inputs(
                text_ids.to(model.device)
            )
        return out


def _ok_row(emb, path) -> dict:
    row = emb.row(path)  # KeyError: not in the manifest
    if row["status"] != "ok":
        raise KeyError(f"{path}: status {row['status']}, no tokens: {row.get('error')}")
    return row


def _timestamps(row: dict) -> list[float]:
    """Frame index / average fps, as the processor's VideoMetadata.timestamps; the decoded
    presentation times where the stream gave no rate."""
    if row.get("fps") and row.get("frame_indices") is not None:
        return [i / row["fps"] for i in row["frame_indices"]]
    return list(row.get("timestamps") or [])


def model_inputs(emb, paths, device=None, dtype=None, model=None) -> ModelInputs:
    """Read `paths`' tokens onto `device` in `dtype` (default: the model's, if a model is given)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    rows = [_ok_row(emb, p) for p in paths]
    if model is not None:
        check_model(emb, rows, model)
    if isinstance(model, torch.nn.Module):
        device = model.device if device is None else device
        dtype = model.dtype if dtype is None else dtype
    media: list = []
    outputs: dict[str, list] = {"image": [], "video": []}
    for path, row in zip(paths, rows):
        frames = [
            torch.as_tensor(f).to(device=device, dtype=dtype) for f in emb.frames(path)
        ]  # numpy reader too
        kind = "video" if row["kind"] == "video" else "image"
        media.append(
            Media(
                row["path"],
                kind,
                [f.shape[0] for f in frames],
                _timestamps(row) if kind == "video" else [],
            )
        )
        outputs[kind] += frames
    return ModelInputs(media, {k: encoder_output(v) for k, v in outputs.items() if v})


# ---- which model the tokens belong to -------------------------------------------------------


def model_named(model) -> tuple[str, int | None]:
    """(name or path, text hidden size) of a model, config, or checkpoint name."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), None
    config = getattr(model, "config", model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "_name_or_path", "") or "", getattr(text, "hidden_size", None)


def same_model(stored: str, revision: str, given: str) -> bool:
    if stored == given:
        return True
    if os.path.isdir(stored) and os.path.isdir(given):
        return os.path.realpath(stored) == os.path.realpath(given)
    # a hub id and its snapshot folder in the Hugging Face cache: …/models--org--name/snapshots/<rev>
    parts = os.path.realpath(given).split(os.sep) if os.path.isdir(given) else []
    if (
        len(parts) >= 3
        and parts[-2] == "snapshots"
        and parts[-3] == "models--" + stored.replace("/", "--")
    ):
        return not revision or revision == parts[-1]
    return False


def check_model(emb, rows: list[dict], model) -> None:
    """The shards' header says which checkpoint made the tokens: it must be `model`."""
    name, hidden = model_named(model)
    for shard in sorted({r["shard"] for r in rows}):
        with safe_open(str(emb.out.shard_path(shard)), framework="pt") as f:
            meta = f.metadata() or {}
        stored = meta.get("model", "")
        if hidden is not None and meta.get("hidden_size") and int(meta["hidden_size"]) != hidden:
            raise ValueError(
                f"{emb.out}: the tokens are {meta['hidden_size']} wide (from {stored}); "
                f"the model given is {hidden} wide"
            )
        if name and not same_model(stored, meta.get("revision", ""), name):
            raise ValueError(
                f"{emb.out}: the tokens were made with {stored!r}, not with {name!r}; "
                "encode with that model, or pass the model the tokens came from"
            )
