"""Find a Gemma 4 checkpoint and load its vision tower and `embed_vision`, and nothing else;
open the towers a run asks for (--model, --dtype, --device/--devices, --compile).

A 31B checkpoint holds ~60 GB of language model; we read the safetensors index, open only the
files that hold `vision_tower.*` / `embed_vision.*` tensors and read only those tensors.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from . import layouts, unified, vision
from .errors import UsageError

if TYPE_CHECKING:
    from .options import Options

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what we read, under either prefix: HF layout has "model.", mlx conversions drop it
PARTS = ("vision_tower.", "embed_vision.")
PREFIXES = ("model.", "")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# model_type → its transformers config; gemma4_unified (12B) has an encoder-free embedder instead of a ViT (unified.py)
CONFIGS = {"gemma4": "Gemma4Config", "gemma4_unified": "Gemma4UnifiedConfig"}


@dataclass(frozen=True)
class Checkpoint:
    name: str  # what the user passed to --model (hub id or path), saved in the output metadata
    root: Path  # local folder holding config.json and the weight files
    config: object  # vision.Config (gemma4), or transformers' Gemma4UnifiedConfig (gemma4_unified)
    tensors: dict[str, dict[str, str]]  # part ("vision_tower."/"embed_vision.") -> {module key: file}
    revision: str | None = None  # hub snapshot hash, when resolved from the cache


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def dtype_name(name: str, device: torch.device) -> str:
    """--dtype: auto is bfloat16 where the device multiplies it natively (CUDA, x86 CPUs with
    AMX: faster than float32 there, docs/benchmarks.md), float32 elsewhere. bfloat16 is also what the released
    checkpoints hold and what transformers loads them in by default."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" or (device.type == "cpu" and cpu_has_amx()) else "float32"


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """The CPU advertises AMX bfloat16 tiles (Linux; False where that cannot be read)."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def parse_device(name: str) -> torch.device:
    """auto → cuda, then mps, then cpu; an explicit device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {name!r}: this torch sees no CUDA device; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise UsageError(f"device {name!r}: MPS is not available here")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {name!r}: use auto, cpu, cuda, cuda:N or mps")
    return device


def _read_config(root: Path, name: str):
    path = root / "config.json"
    if not path.is_file():
        raise UsageError(f"{name}: no config.json in {root}; --model needs a Hugging Face checkpoint folder")
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


def _vision_tensors(weight_map: dict[str, str], name: str) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {part: {} for part in PARTS}
    for key, file in weight_map.items():
        for prefix in PREFIXES:
            for part in PARTS:
                if key.startswith(prefix + part):
                    found[part][key] = file
    if not found["vision_tower."]:
        raise UsageError(f"{name}: the checkpoint holds no vision_tower.* tensors")
    if not found["embed_vision."]:
        raise UsageError(f"{name}: the checkpoint holds no embed_vision.* tensors")
    return found


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
            raise UsageError(f"--revision {revision}: {model} is a local folder; --revision is for a hub id")
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
    select = unified.vision_tensors if unified.is_unified(config) else _vision_tensors
    tensors = select(_weight_map(root, model), model)
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


def load_modules(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device):
    """Build the tower and embed_vision (vision.py) on meta, then assign the read tensors.

    Loading is strict: a dropped clip bound or std buffer would silently change the output
    (their defaults are ±inf and garbage).
    """
    vcfg, tcfg = ckpt.config.vision_config, ckpt.config.text_config
    with torch.device("meta"):
        tower = vision.VisionModel(vcfg)
        embed = vision.Embedder(vcfg, tcfg.hidden_size)
    modules = {"vision_tower.": tower, "embed_vision.": embed}
    ckpt = layouts.resolve(ckpt, {part: module.state_dict().keys() for part, module in modules.items()})
    for part, module in modules.items():
        state = read_tensors(ckpt, part)
        layouts.refuse_integer(state, ckpt.name, ckpt.config, part)
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise UsageError(f"{ckpt.name}: {part}* tensors do not match the config: {str(e).splitlines()[0]}") from None
    return tower.place(device, dtype), embed.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tower(model: str, dtype: str = "float32", device: str = "auto", revision: str | None = None):
    """--model, --dtype, --device, --revision → a ready Tower (vision weights only)."""
    from .tower import Tower

    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    ckpt = find_checkpoint(model, revision)
    if unified.is_unified(ckpt.config):
        return unified.load_tower(ckpt, torch_dtype, torch_device)
    tower, embed = load_modules(ckpt, torch_dtype, torch_device)
    return Tower(tower, embed, torch_device, torch_dtype, checkpoint=ckpt)


def devices(options: Options) -> list[str]:
    """--devices (all | a comma list) or the one --device."""
    if not options.devices:
        return [options.device]
    if options.devices == "all":
        if not torch.cuda.is_available():
            raise UsageError("--devices all: this torch sees no CUDA device; use --device cpu")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    names = [d.strip() for d in options.devices.split(",") if d.strip()]
    if not names:
        raise UsageError(f"--devices {options.devices!r}: use all or a list like cuda:0,cuda:1")
    return names


def open_tower(options: Options, device: str | None = None):
    """--model, --dtype, --device (or `device`), --batching → (tower, dtype name, batching mode)."""
    from .plan import resolve_batching

    device = device or options.device
    dtype = dtype_name(options.dtype, parse_device(device))
    tower = load_tower(options.model, dtype, device, options.revision)
    if options.compile:
        tower.compile()
    return tower, dtype, resolve_batching(options.batching, tower.device, tower.attention)


def resolve_dtype(options: Options) -> str:
    """--dtype auto → the dtype this run's towers will run in, decided once before the run so that
    settings.json records it and every tower (every Ray actor too) uses the same one."""
    if options.dtype != "auto":
        return options.dtype
    if options.engine == "ray" and options.device in ("cpu", "cuda"):
        return dtype_name("auto", torch.device(options.device))  # the actors' device, not this one's
    # the local engine's first device; a private Ray runs on this machine, so --device auto is this one's too
    return dtype_name("auto", parse_device(devices(options)[0]))
