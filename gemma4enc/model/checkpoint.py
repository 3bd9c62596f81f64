"""Find a Gemma 4 checkpoint (a local folder in Hugging Face layout, or a hub id: hub/) and read
only its vision tensors.

A 31B checkpoint holds ~60 GB of language model; we read the safetensors index, open only the
files that hold the vision parts' tensors (layouts.py names them) and read only those tensors."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UsageError
from . import layouts, vision
from .layouts import INDEX, SINGLE

# model_type → its transformers config; gemma4_unified (12B) has an encoder-free embedder instead of a ViT (unified.py)
CONFIGS = {"gemma4": "Gemma4Config", "gemma4_unified": "Gemma4UnifiedConfig"}


@dataclass(frozen=True)
class Checkpoint:
    name: str  # what the user passed to --model (hub id or path), saved in the output metadata
    root: Path  # local folder holding config.json and the weight files
    config: object  # vision.Config (gemma4), or transformers' Gemma4UnifiedConfig (gemma4_unified)
    tensors: dict[str, dict[str, str]]  # part ("vision_tower."/"embed_vision.") -> {module key: file}
    revision: str | None = None  # hub snapshot hash, when resolved from the cache


def _read_config(root: Path, name: str):
    path = root / "config.json"
    if not path.is_file():
        raise UsageError(
            f"{name}: no config.json in {root}; --model needs a Hugging Face checkpoint folder"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{name}: cannot read config.json ({e})") from None
    if raw.get("model_type") not in CONFIGS:
        raise UsageError(
            f"{name}: not a Gemma 4 checkpoint (model_type={raw.get('model_type')!r}, "
            f"expected {' or '.join(map(repr, CONFIGS))})"
        )
    if not raw.get("vision_config"):
        raise UsageError(f"{name}: this Gemma 4 checkpoint has no vision tower (no vision_config)")
    if raw["model_type"] == "gemma4":
        return vision.Config(raw, name)  # no transformers import: see vision.py
    import transformers  # the unified model's embedder is transformers' own module (unified.py)

    return getattr(transformers, CONFIGS[raw["model_type"]]).from_dict(raw)


def _weight_map(root: Path, name: str) -> dict[str, str]:
    """Every tensor name -> the file that holds it, reading only headers."""
    if (root / INDEX).is_file():
        return json.loads((root / INDEX).read_text())["weight_map"]
    if (root / SINGLE).is_file():
        with safe_open(str(root / SINGLE), framework="pt") as f:
            return {key: SINGLE for key in f.keys()}
    raise UsageError(f"{name}: no {SINGLE} or {INDEX} in {root}")


def _hub_files(repo_id: str, revision: str | None) -> tuple[Path, str | None]:
    """A hub id → a local folder: only the config and the vision tensors' bytes, fetched by range
    requests into a cache keyed by commit (or a full snapshot already in the HF cache); hub.py."""
    from .hub import hub_files

    return hub_files(repo_id, revision)


def _local_folder(model: str, revision: str | None) -> Path | None:
    """--model as a local checkpoint folder, or None for a hub id; anything else is a UsageError."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            raise UsageError(
                f"--revision {revision}: {model} is a local folder; --revision is for a hub id"
            )
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise UsageError(f"{model}: no such checkpoint folder (and not a hub id like 'org/name')")
    return None


def read_config(model: str, revision: str | None = None):
    """--model's config alone, for what needs only its widths (plan): a hub id's config.json is
    fetched by itself, not its vision tensors."""
    root = _local_folder(model, revision)
    if root is None:
        from .hub import config_file

        root = config_file(model, revision).parent
    return _read_config(root, model)


def find_checkpoint(model: str, revision: str | None = None) -> Checkpoint:
    """--model: a local folder in Hugging Face layout, or a hub id resolved through the cache
    (at --revision: a branch, tag or commit; main by default)."""
    root = _local_folder(model, revision)
    if root is None:
        root, revision = _hub_files(model, revision)
    config = _read_config(root, model)
    tensors = layouts.vision_tensors(config, _weight_map(root, model), model)
    layouts.refuse_quantized(config, tensors, model)
    return Checkpoint(name=model, root=root, config=config, tensors=tensors, revision=revision)


def read_tensors(ckpt: Checkpoint, part: str) -> dict[str, torch.Tensor]:
    """The tensors of one part, keyed by module path (prefix stripped), opening only their files."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for key, file in ckpt.tensors[part].items():
        by_file[file].append(key)
    state = {}
    for file, keys in sorted(by_file.items()):
        with safe_open(str(ckpt.root / file), framework="pt") as f:
            for key in keys:
                state[key.split(part, 1)[1]] = f.get_tensor(key)
    return state
