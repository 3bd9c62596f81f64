"""What a real checkpoint holds under the vision parts, and what we do with each key.

Released and re-published Gemma 4 checkpoints carry more than the modules use (see
docs/architecture.md, "Real checkpoints"):

- leftovers nobody reads: `embed_vision.embedding.*` and Gemma 3n-era embedding norms (vLLM
  skips them on purpose), and clip scalars (`input_min` …) in checkpoints whose config says
  `use_clipped_linears: false` (mlx-vlm drops those). They are skipped, with one log line;
- a quantized vision tower (bitsandbytes, compressed-tensors, ModelOpt, MLX, FP8, GPTQ/AWQ):
  refused, naming the format, because the soft tokens must come from the bf16 weights;
- anything else that is not what the config's modules hold, or a tensor they need and the
  checkpoint lacks: an error naming the first three.

Everything here works on key names (and the config), so it runs before any tensor is read.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import replace

from ..errors import UsageError

log = logging.getLogger("gemma4enc.model.layouts")

# (pattern on "part.key", why it is unused); any prefix ("model." or none) is stripped first
LEFTOVERS = (
    (re.compile(r"^embed_vision\.embedding\."), "Gemma 3n-era embedding"),
    (
        re.compile(
            r"^embed_vision\.(hard_embedding_norm|soft_embedding_norm|embedding_post_projection_norm)\."
        ),
        "Gemma 3n-era embedding norm",
    ),
)
CLIP_SCALAR = re.compile(r"\.(input_min|input_max|output_min|output_max)$")

# (key pattern, format) for quantized weights; the first that matches names the format
QUANT_KEYS = (
    (
        re.compile(r"\.(absmax|quant_map|nested_absmax|nested_quant_map)$|\.quant_state\."),
        "bitsandbytes 4-bit",
    ),
    (re.compile(r"\.(SCB|weight_format)$"), "bitsandbytes 8-bit"),
    (
        re.compile(r"\.(weight_packed|weight_shape|weight_global_scale|weight_zero_point)$"),
        "compressed-tensors",
    ),
    (re.compile(r"\.(weight_scale_2|input_scale)$"), "ModelOpt"),
    (re.compile(r"\.weight_scale_inv$"), "FP8 (block scales)"),
    (re.compile(r"\.(scales|biases)$"), "MLX affine"),
    (re.compile(r"\.(qweight|qzeros|g_idx)$"), "GPTQ/AWQ"),
    (re.compile(r"\.weight_scale$"), "quantized (weight_scale)"),
)
FLOATS = ("torch.float32", "torch.bfloat16", "torch.float16")
# the lists in a quantization_config that name modules left in floating point
EXCLUSIONS = (
    "llm_int8_skip_modules",
    "modules_to_not_convert",
    "ignore",
    "exclude_modules",
    "ignored_layers",
    "skip_modules",
)
# a linear layer's module path inside a vision part (what quantizers replace)
LINEAR = re.compile(r"^(.*?(?:_proj(?:\.linear)?|embedding_projection|patch_dense))\.")
# text hidden size → the released model whose bf16 checkpoint to use instead
SIZES = {1536: "E2B", 2560: "E4B", 2816: "26B-A4B", 5376: "31B", 3840: "12B"}


# The checkpoint files we read, and the tensor-name parts of each model's vision: any key under
# PREFIXES + a part ("model." in the HF layout; mlx conversions drop it) is read, the rest never
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PREFIXES = ("model.", "")
GEMMA4_PARTS = ("vision_tower.", "embed_vision.")
# gemma4_unified (the 12B): the released layout keeps the embedder under `vision_embedder.` and the
# projection under `embed_vision.`; transformers' own module names put both under `embed_vision.`
UNIFIED = "gemma4_unified"
UNIFIED_PARTS = ("vision_embedder.", "embed_vision.")
VISION_PARTS = ("vision_tower.", "embed_vision.", "vision_embedder.")  # any model's


def is_vision(key: str) -> bool:
    """A tensor name of any model's vision (what a fetch from the hub keeps)."""
    return any(key.startswith(prefix + part) for prefix in PREFIXES for part in VISION_PARTS)


def is_unified(config) -> bool:
    return getattr(config, "model_type", None) == UNIFIED


def vision_tensors(config, weight_map: dict[str, str], name: str) -> dict[str, dict[str, str]]:
    """part → {tensor name: file} for the model's vision, reading no tensor."""
    return (
        _unified_tensors(weight_map, name) if is_unified(config) else _gemma4_tensors(weight_map, name)
    )


def _gemma4_tensors(weight_map: dict[str, str], name: str) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {part: {} for part in GEMMA4_PARTS}
    for key, file in weight_map.items():
        for prefix in PREFIXES:
            for part in GEMMA4_PARTS:
                if key.startswith(prefix + part):
                    found[part][key] = file
    for part in GEMMA4_PARTS:
        if not found[part]:
            raise UsageError(f"{name}: the checkpoint holds no {part}* tensors")
    return found


def _unified_tensors(weight_map: dict[str, str], name: str) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {part: {} for part in UNIFIED_PARTS}
    for key, file in weight_map.items():
        part = next((p for p in UNIFIED_PARTS if key.removeprefix("model.").startswith(p)), None)
        if part:
            found[part][key] = file
    if not any("patch_dense." in k for part in found.values() for k in part):
        raise UsageError(
            f"{name}: this gemma4_unified checkpoint holds no vision_embedder.patch_dense tensor"
        )
    return found


def split(key: str, parts) -> tuple[str, str, str] | None:
    """'model.vision_tower.a.b' → ('model.', 'vision_tower.', 'a.b'), or None outside the parts."""
    for prefix in ("model.", ""):
        for part in parts:
            if key.startswith(prefix + part):
                return prefix, part, key[len(prefix + part) :]
    return None


# ---- quantized vision weights -------------------------------------------------------------


def refuse_quantized(config, tensors: dict[str, dict[str, str]], name: str) -> None:
    """UsageError if the vision weights are quantized (by their key names, or a quantization
    config that covers them), naming the format and the bf16 checkpoint to use instead."""
    keys = [key for part in tensors.values() for key in part]
    for key in keys:
        for pattern, fmt in QUANT_KEYS:
            if pattern.search(key):
                raise UsageError(
                    _quantized(name, config, _config_format(config) or fmt, f"tensor {key}")
                )
    fmt = _config_format(config)
    if fmt and _covers(config, keys):
        raise UsageError(
            _quantized(name, config, fmt, "config.json's quantization settings cover the vision tower")
        )


def refuse_integer(state: dict, name: str, config, part: str) -> None:
    """A vision weight stored in an integer or 8-bit float dtype is quantized whatever its name says."""
    for key, tensor in state.items():
        if str(tensor.dtype) not in FLOATS:
            raise UsageError(
                _quantized(
                    name,
                    config,
                    _config_format(config) or f"{str(tensor.dtype)[6:]} weights",
                    f"tensor {part}{key} is {str(tensor.dtype)[6:]}",
                )
            )


def _quantized(name: str, config, fmt: str, evidence: str) -> str:
    return (
        f"{name}: the vision tower is quantized ({fmt}; {evidence}); gemma4enc encodes with the floating-point "
        f"vision weights: use the bf16 checkpoint of the same model, {_bf16_id(name, config)}"
    )


def _bf16_id(name: str, config) -> str:
    """google/gemma-4-<size>[-it] for this model's size (by its text width), instruct unless the name says base."""
    size = SIZES.get(getattr(getattr(config, "text_config", None), "hidden_size", None))
    if getattr(config, "model_type", None) == "gemma4_unified":
        size = "12B"  # the one unified model released
    if size is None:
        return "e.g. google/gemma-4-E2B-it"
    named = re.search(r"gemma-4-[0-9a-z-]*?b(-a4b)?(-it)?(?![0-9a-z])", name.lower())
    base = named is not None and named.group(2) is None
    return f"google/gemma-4-{size}" + ("" if base else "-it")


def _quant_config(config) -> dict:
    qc = getattr(config, "quantization_config", None) or {}
    return qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: {})()


def _config_format(config) -> str | None:
    """The quantization format config.json declares, in words (None: none declared)."""
    qc = _quant_config(config)
    method = qc.get("quant_method")
    if method == "bitsandbytes":
        return "bitsandbytes 4-bit" if qc.get("load_in_4bit") else "bitsandbytes 8-bit"
    if method == "compressed-tensors":
        return f"compressed-tensors {qc['format']}" if qc.get("format") else "compressed-tensors"
    if method == "modelopt":
        return f"ModelOpt {qc['quant_algo']}" if qc.get("quant_algo") else "ModelOpt"
    if method:
        return str(method)
    mlx = getattr(config, "quantization", None)
    if isinstance(mlx, dict) and "bits" in mlx:
        return f"MLX affine {mlx['bits']}-bit"
    return None


def _covers(config, keys: list[str]) -> bool:
    """Whether the declared quantization reaches a vision linear layer: some linear module that
    no exclusion list names (read leniently: a doubtful entry counts as excluding it)."""
    qc = _quant_config(config)
    modules = {m.group(1) for key in keys if (m := LINEAR.match(key))}
    if (
        not qc
    ):  # MLX: vision is quantized only where its own entry says how (mlx-vlm skips it by default)
        mlx = getattr(config, "quantization", None) or {}
        return any(isinstance(v, dict) and _names(k, m) for k, v in mlx.items() for m in modules)
    excluded = [e for field in EXCLUSIONS for e in (qc.get(field) or [])]
    targets = [t for group in (qc.get("config_groups") or {}).values() for t in group.get("targets", [])]
    return any(
        not any(_names(e, m) for e in excluded) and (not targets or any(_targets(t, m) for t in targets))
        for m in modules
    )


def _names(entry: str, module: str) -> bool:
    """A module-list entry ("re:…", a glob, a path or a part of one) names this module (either prefix)."""
    entry = str(entry)
    candidates = (module, module.removeprefix("model."), "model." + module.removeprefix("model."))
    if entry.startswith("re:"):
        return any(re.search(entry[3:], c) for c in candidates)
    if any(ch in entry for ch in "*?["):
        return any(fnmatch.fnmatch(c, entry) for c in candidates)
    return any(entry.strip(".") in c for c in candidates)


def _targets(target: str, module: str) -> bool:
    """A compressed-tensors target reaches the module: a class name (Linear) reaches every linear."""
    return "." not in target and not target.startswith("re:") or _names(target, module)


# ---- the keys the modules expect ----------------------------------------------------------


def resolve(ckpt, expected: dict[str, object]):
    """`ckpt` with each part's tensors cut to the keys its module expects (`expected`: part →
    that module's state_dict keys). Known leftovers are dropped with one log line; a missing
    tensor, or one nobody knows, is a UsageError naming the first three."""
    tensors, skipped = dict(ckpt.tensors), []
    clipped = getattr(ckpt.config.vision_config, "use_clipped_linears", False)
    for part, keys in expected.items():
        found = {split(k, (part,))[2]: k for k in ckpt.tensors.get(part, {})}
        want = set(keys)
        missing = sorted(want - set(found))
        if missing:
            prefix = next((split(k, (part,))[0] for k in found.values()), "model.")
            raise UsageError(
                f"{ckpt.name}: the checkpoint lacks {len(missing)} {part}* tensor(s) the config needs: "
                f"{first(prefix + part + k for k in missing)}"
            )
        unknown = []
        for rel in sorted(set(found) - want):
            why = _leftover(part + rel, clipped)
            (skipped.append((found[rel], why)) if why else unknown.append(found[rel]))
        if unknown:
            raise UsageError(
                f"{ckpt.name}: {len(unknown)} {part}* tensor(s) that the config's modules do not have "
                f"(another model size, or a config that does not match?): {first(unknown)}"
            )
        tensors[part] = {found[rel]: ckpt.tensors[part][found[rel]] for rel in want}
    if skipped:
        _say(ckpt.name, skipped)
    return replace(ckpt, tensors=tensors)


def _leftover(key: str, clipped: bool) -> str | None:
    for pattern, why in LEFTOVERS:
        if pattern.search(key):
            return why
    if not clipped and key.startswith("vision_tower.") and CLIP_SCALAR.search(key):
        return "clip scalar unused with use_clipped_linears: false"
    return None


_said: set[str] = set()  # one line per checkpoint and process, however many towers open it


def _say(name: str, skipped: list[tuple[str, str]]) -> None:
    reasons = sorted({why for _, why in skipped})
    line = (
        f"gemma4enc: {name}: skipped {len(skipped)} tensor(s) the vision modules do not use ({'; '.join(reasons)}): "
        f"{first(key for key, _ in skipped)}"
    )
    if line not in _said:
        _said.add(line)
        log.warning(line)


def first(names, limit: int = 3) -> str:
    """The first `limit` names, and how many more."""
    names = list(names)
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")
