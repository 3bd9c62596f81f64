"""Open the towers a run asks for (--model, --dtype, --device/--devices, --compile): the modules
built on meta (vision.py, unified.py) and given the checkpoint's tensors."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import layouts, unified, vision
from .checkpoint import find_checkpoint, read_tensors

if TYPE_CHECKING:
    from ..options import Options
from ..errors import UsageError
from .checkpoint import Checkpoint

TOWER_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
)  # options.DTYPES without auto, which dtype_name resolves


def parse_dtype(name: str) -> torch.dtype:
    try:
        if name not in TOWER_DTYPES:
            raise KeyError(name)
        return getattr(torch, name)
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: use one of {', '.join(TOWER_DTYPES)}") from None


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
            raise UsageError(
                f"{ckpt.name}: {part}* tensors do not match the config: {str(e).splitlines()[0]}"
            ) from None
    return tower.place(device, dtype), embed.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tower(model: str, dtype: str = "float32", device: str = "auto", revision: str | None = None):
    """--model, --dtype, --device, --revision → a ready Tower (vision weights only)."""
    from .tower import Tower

    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    ckpt = find_checkpoint(model, revision)
    if layouts.is_unified(ckpt.config):
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
    from .batching import resolve_batching

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
