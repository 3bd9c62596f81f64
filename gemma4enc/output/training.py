"""Fine-tune Gemma 4 on the stored soft tokens: a conversations dataset and a collator for `Trainer`.

With the vision tower frozen, what it gives for a photo never changes, and the shards hold exactly
that (`embed_vision`'s output). A step from them is the step from the pixels without the decode,
the resize and the tower. `Conversations` reads a JSONL of chat-template conversations whose image
and video parts name files of an OUT and checks the whole file first; `Collator` writes the prompt
with the model's own chat template, expands each placeholder as Gemma4Processor does (gemma.py),
masks everything but the assistant turns and hands the model `mm_encoder_outputs`.
Recipe: docs/training.md.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..media.remote import is_url
from ..rows import Row
from . import gemma
from .openreader import open_reader
from .out import Out

KINDS = ("image", "video")
# where a chat-template media part names its file, in the order transformers' processors look
SOURCE_KEYS = ("path", "image", "video", "url")
# shard header keys that shape the tokens (shards.shard_metadata); producer and out_dtype do not
SETTINGS = (
    "model",
    "revision",
    "dtype",
    "image_soft_tokens",
    "resize",
    "video_soft_tokens",
    "sampling",
    "hidden_size",
)
IGNORE = -100  # the label PyTorch's cross entropy skips


class TrainingDataError(ValueError):
    """A conversations file that names media the OUT cannot give tokens for."""


# ---- the conversations file ------------------------------------------------------------------


def media_parts(messages: list[dict]) -> list[dict]:
    """The image / video parts of a conversation, in the order the template writes them."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in KINDS
    ]


def _source(part: dict) -> str:
    for key in SOURCE_KEYS:
        if isinstance(part.get(key), (str, os.PathLike)):
            return os.fspath(part[key])
    raise TrainingDataError(
        f"a {part['type']} part names no file (one of {', '.join(SOURCE_KEYS)}): {part}"
    )


def read_conversations(jsonl: str | os.PathLike) -> list[dict]:
    """One example per line: {"messages": [...], ...} or a bare list of messages."""
    examples = []
    with open(jsonl, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainingDataError(f"{jsonl}:{number}: not JSON ({e.msg})") from None
            example = {"messages": example} if isinstance(example, list) else example
            if not isinstance(example, dict) or not isinstance(example.get("messages"), list):
                raise TrainingDataError(
                    f"{jsonl}:{number}: an example is a list of messages or has \"messages\""
                )
            examples.append(example)
    return examples


def _resolved(example: dict, root: Path | None) -> dict:
    """The example with each media part's file as an absolute path (relative ones below `root`),
    under "path", the key transformers' processors read first."""
    messages = []
    for m in example["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in KINDS:
                    source = _source(part)
                    path = Path(source).expanduser()
                    if is_url(source):  # keyed as written (a Path would fold its //)
                        resolved = source
                    else:
                        resolved = os.path.abspath(root / path if root and not path.is_absolute() else path)
                    part = {**part, "path": resolved}
                parts.append(part)
            m = {**m, "content": parts}
        messages.append(m)
    return {**example, "messages": messages}


# ---- the whole-file check --------------------------------------------------------------------


@dataclass
class Check:
    """What `check` found: every media path the examples name, sorted by what is wrong with it."""

    examples: int = 0
    media: int = 0  # media parts, counting repeats
    missing: list[str] = field(default_factory=list)  # not in the manifest
    failed: list[str] = field(default_factory=list)  # "path: status: error"
    other: list[str] = field(default_factory=list)  # "path: what differs"

    def __bool__(self) -> bool:  # true when there is nothing to report
        return not (self.missing or self.failed or self.other)

    def summary(self) -> str:
        from ..errors import first_lines

        head = f"{self.examples} examples, {self.media} media parts"
        if self:
            return head + ": every one has tokens in the OUT"
        parts = [
            f"{len(items)} {what} ({first_lines(items)})"
            for what, items in (
                ("not in the OUT", self.missing),
                ("failed", self.failed),
                ("encoded with other settings", self.other),
            )
            if items
        ]
        return f"{head}: " + "; ".join(parts)


def _headers(emb, shards: set[str]) -> dict[str, dict]:
    from safetensors import safe_open

    headers = {}
    for shard in sorted(shards):
        with safe_open(str(emb.out.shard_path(shard)), framework="pt") as f:
            headers[shard] = f.metadata() or {}
    return headers


def _model_differs(header: dict, model) -> str | None:
    name, hidden = gemma.model_named(model)
    if hidden is not None and header.get("hidden_size") and int(header["hidden_size"]) != hidden:
        return f"{header['hidden_size']} wide, the model is {hidden} wide"
    if name and not gemma.same_model(header.get("model", ""), header.get("revision", ""), name):
        return f"made with {header.get('model')!r}, not {name!r}"
    return None


def check(emb, examples: list[dict], model=None, expect: dict | None = None) -> Check:
    """Every media path of `examples` (resolved) against the OUT, without reading a token: in the
    manifest, status ok, of the kind the part says, and from shards written with the same settings
    (the ones most of the paths have, `expect`'s keys pinned: {"image_soft_tokens": 280}) and by
    `model` when given (its name or folder, and its width)."""
    unknown = sorted(set(expect or {}) - set(SETTINGS))
    if unknown:  # a typo would pin nothing and check nothing
        raise ValueError(
            f"expect: unknown key(s) {', '.join(map(repr, unknown))}; the settings a shard records "
            f"are {', '.join(SETTINGS)}"
        )
    found = Check(examples=len(examples))
    rows: dict[str, Row] = {}
    missing: set[str] = set()
    seen: set[tuple[str, str]] = set()  # (path, "image" or "video")
    for example in examples:
        for part in media_parts(example["messages"]):
            found.media += 1
            path = part["path"]
            if (path, part["type"]) in seen or path in missing:
                continue
            seen.add((path, part["type"]))
            try:
                row = rows[path] if path in rows else emb.row(path)
            except KeyError:
                found.missing.append(path)
                missing.add(path)
                continue
            if row["status"] != "ok":
                if path not in rows:
                    found.failed.append(f"{path}: {row['status']}: {row.get('error')}")
            elif row["kind"] != part["type"]:
                found.other.append(f"{path}: a {row['kind']}, the conversation says {part['type']}")
            rows[path] = row
    ok = {p: r for p, r in rows.items() if r["status"] == "ok"}
    headers = _headers(emb, {r["shard"] for r in ok.values()})
    settings = {s: {k: h.get(k) for k in SETTINGS} for s, h in headers.items()}
    usual = Counter(json.dumps(settings[r["shard"]], sort_keys=True) for r in ok.values()).most_common(1)
    want = {
        **(json.loads(usual[0][0]) if usual else {}),
        **{k: str(v) for k, v in (expect or {}).items()},
    }
    for path, row in ok.items():
        header = headers[row["shard"]]
        differs = [f"{k} {header.get(k)!r}, want {want[k]!r}" for k in want if header.get(k) != want[k]]
        if header.get("store") == "pooled":
            differs.append("only its pooled vector is stored (--store pooled), not its tokens")
        if model is not None and (why := _model_differs(header, model)):
            differs.append(why)
        if differs:
            found.other.append(f"{path} ({row['shard']}): " + ", ".join(differs))
    return found


# ---- the dataset -----------------------------------------------------------------------------


def _has_tokens(out: Out) -> None:
    """An OUT encoded with --store pooled keeps no tokens to train on: said before anything is read."""
    settings = out.settings()
    if settings is None:
        return  # no settings to tell by: check() looks at every shard's header
    if settings.get("store") == "pooled":
        raise TrainingDataError(
            f"{out} was encoded with --store pooled: it keeps each file's pooled vector, not the "
            "tokens the model is trained on; encode the media again into an OUT without --store pooled"
        )


class Conversations(torch.utils.data.Dataset):
    """Examples of a conversations file with their media as stored tokens: no decode, no tower.

    `out`: an OUT folder or its reader (gemma4enc.open). `conversations`: a JSONL path (relative
    media paths are below its folder, or `root`) or a list of examples. The whole file is checked
    first (`check`); anything to report raises TrainingDataError with the counts and the first
    paths. Item i: {"messages": …, "media": gemma.ModelInputs of its media, in order}, the tokens
    in their stored dtype (the collator moves them onto the model)."""

    def __init__(self, out, conversations, model=None, expect: dict | None = None, root=None):
        self.emb = out if hasattr(out, "frames") else open_reader(out)
        _has_tokens(self.emb.out)
        if isinstance(conversations, (str, os.PathLike)):
            root = Path(conversations).parent if root is None else root
            conversations = read_conversations(conversations)
        root = Path(root) if root is not None else None
        self.examples = [
            _resolved({"messages": e} if isinstance(e, list) else e, root) for e in conversations
        ]
        self.report = check(self.emb, self.examples, model, expect)
        if not self.report:
            raise TrainingDataError(self.report.summary())

    def __len__(self) -> int:
        return len(self.examples)

    # DataLoader workers that spawn (macOS, Windows, CUDA setups) pickle the dataset: the reader
    # holds the open manifest, so a worker opens the OUT afresh
    def __getstate__(self) -> dict:
        return {**self.__dict__, "emb": self.emb.out.url}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, emb=open_reader(state["emb"]))

    def as_dataset(self):
        """A `datasets.Dataset` of the example numbers, for trainers that take no other kind (TRL's
        SFTTrainer): `Collator(…, out=this)` turns each {"example": i} back into item i. The
        messages stay out of Arrow, which would give every part every key and one type per field."""
        from datasets import Dataset

        return Dataset.from_dict({"example": list(range(len(self)))})

    def __getitem__(self, i: int) -> dict:
        example = self.examples[i]
        paths = [part["path"] for part in media_parts(example["messages"])]
        return {"messages": example["messages"], "media": gemma.model_inputs(self.emb, paths)}


# ---- the collator ----------------------------------------------------------------------------


def _assistant_spans(render, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation, and the character spans of what each assistant turn adds to the
    prompt the template writes before it (the generation prompt): its text and end of turn.

    Found by rendering the conversation up to each assistant turn, so it holds for any template
    that renders a turn the same whatever follows it (TRL's prompt-completion split assumes the
    same); one that does not is refused rather than trained on the wrong tokens."""
    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        upto = render(messages[: i + 1], False)
        if not full.startswith(upto):
            raise ValueError(
                f"the chat template writes turn {i} differently once later turns follow it; "
                "split the conversation so that each example ends with the turn to train"
            )
        prompt = render(messages[:i], True)
        start = len(
            os.path.commonprefix([prompt, upto])
        )  # a template may open the turn other than its prompt
        spans.append((start, len(upto)))
    return full, spans


def merge(inputs: list[gemma.ModelInputs]) -> gemma.ModelInputs:
    """Several examples' media as one batch's, in example order (the order their placeholders
    have in the padded batch, which is the order the model fills them)."""
    media = [m for i in inputs for m in i.media]
    outputs = {
        k: [
            t for i in inputs if k in i.mm_encoder_outputs for t in i.mm_encoder_outputs[k].pooler_output
        ]
        for k in KINDS
    }
    return gemma.ModelInputs(media, {k: gemma.encoder_output(v) for k, v in outputs.items() if v})


class Collator:
    """A batch of `Conversations` items → what Gemma4ForConditionalGeneration.forward takes with
    labels: input_ids, attention_mask, mm_token_type_ids, labels, mm_encoder_outputs.

    `processor`: the model's Gemma4Processor or tokenizer, whose chat template writes the prompt
    (`template_kwargs` go to it, e.g. enable_thinking). Each image / video part becomes the
    processor's placeholders for the stored counts (video: per frame its mm:ss time); labels are
    the ids of what the assistant turns add and -100 elsewhere (prompt, soft tokens, padding).
    `model`: the tokens go onto its device and dtype (or `device` / `dtype`); keep `device="cpu"`
    where a DataLoader's worker processes collate. `out`, for items that come without their media:
    a `Conversations` turns {"example": i} into its item i (`Conversations.as_dataset`); an OUT (or
    its reader) reads the media of {"messages": …} rows of your own `datasets.Dataset` by their
    paths as they are, absolute or from the working folder (unchecked: `check` them first)."""

    def __init__(
        self,
        processor,
        model=None,
        device=None,
        dtype=None,
        template_kwargs: dict | None = None,
        out=None,
    ):
        self.source = out if isinstance(out, Conversations) else None
        if self.source is not None:
            self.emb = self.source.emb
        else:
            self.emb = out if out is None or hasattr(out, "frames") else open_reader(out)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(
                "the collator needs a fast tokenizer (its offsets tell which tokens an assistant wrote)"
            )
        self.device = device if device is not None else getattr(model, "device", None)
        self.dtype = dtype if dtype is not None else getattr(model, "dtype", None)
        self.template_kwargs = dict(template_kwargs or {})

    def _read(self, messages: list[dict]) -> gemma.ModelInputs:
        if self.emb is None:
            raise ValueError("an item without its media: give Collator(out=…) the OUT to read them from")
        return gemma.model_inputs(self.emb, [_source(part) for part in media_parts(messages)])

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def __call__(self, examples: list[dict]) -> dict:
        if self.source is not None:
            examples = [self.source[e["example"]] if "example" in e else e for e in examples]
        inputs = merge([e["media"] if "media" in e else self._read(e["messages"]) for e in examples])
        # each example cut where its trained spans start and end; the placeholders are expanded
        # piece by piece, in order, so the cuts move with the expansion
        pieces, trained, owner = [], [], []
        for n, example in enumerate(examples):
            text, spans = _assistant_spans(self.render, example["messages"])
            cuts = sorted({0, len(text), *(c for s in spans for c in s)})
            for a, b in itertools.pairwise(cuts):
                pieces.append(text[a:b])
                trained.append(any(s <= a and b <= e for s, e in spans))
                owner.append(n)
        pieces = inputs.prompt(pieces, gemma.Tokens.of(self.tokenizer))
        texts = [""] * len(examples)
        owned: list[list[tuple[int, int]]] = [[] for _ in examples]  # each example's trained spans
        for piece, train, n in zip(pieces, trained, owner):
            if train:
                owned[n].append((len(texts[n]), len(texts[n]) + len(piece)))
            texts[n] += piece
        # as processor.apply_chat_template(tokenize=True): a template that writes <bos> gets no second one
        bos = self.tokenizer.bos_token
        batch = inputs.tokenize_expanded(
            self.tokenizer,
            texts,
            return_offsets_mapping=True,
            add_special_tokens=not (bos and texts[0].startswith(bos)),
        )
        outputs = batch.pop("mm_encoder_outputs")
        start, end = batch.pop("offset_mapping").unbind(-1)
        keep = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for n, row in enumerate(owned):
            for a, b in row:
                keep[n] |= (start[n] >= a) & (start[n] < b) & (end[n] > start[n])
        keep &= batch["attention_mask"].bool() & (batch["mm_token_type_ids"] == 0)
        batch["labels"] = batch["input_ids"].masked_fill(~keep, IGNORE)
        batch = {k: v.to(self.device) if self.device is not None else v for k, v in batch.items()}
        batch["mm_encoder_outputs"] = {
            k: gemma.encoder_output([t.to(device=self.device, dtype=self.dtype) for t in o.pooler_output])
            for k, o in outputs.items()
        }
        return batch


def freeze_vision(model) -> list[str]:
    """Stop gradients into what made the stored tokens (the vision tower and `embed_vision`, the
    projection whose output the shards hold): the model is then the one the tokens stand in for.
    Returns the frozen parameters' names."""
    frozen = []
    for name, param in model.named_parameters():
        if ".vision_tower." in f".{name}" or ".embed_vision." in f".{name}":
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
