"""`gemma4enc bench`: the batching paths side by side on a random tower of a released size.

Methods run interleaved in one process, round after round, and each is reported by its
median: `hf-padded` (what a transformers user writes: processor-padded batches through the
vision model and embed_vision), `serial`, `bucket`, `pack`. Speed-ups are ratios of medians
measured in the same run.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..media.patches import POOL, Patches, patchify
from ..model.batching import CPU_PATCHES, Unit, batches, resolve_batching
from ..model.tower import Tower

SIZES = {  # released vision towers (hidden, layers, heads, head_dim, mlp, text hidden)
    "e2b": dict(
        hidden_size=768,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
        intermediate_size=3072,
        use_clipped_linears=True,
        standardize=False,
        text=1536,
    ),
    "26b": dict(
        hidden_size=1152,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=72,
        intermediate_size=4304,
        use_clipped_linears=False,
        standardize=True,
        text=2816,
    ),
    # gemma4_unified (google/gemma-4-12B-it): no ViT; its embedder is 3840 wide, as is its language model
    "12b": dict(unified=True, num_hidden_layers=0, mm_embed_dim=3840, text=3840),
}
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "4090": 165e12,
}
HF_BATCH = 8  # images per get_image_features call in the hf-padded baseline


def default_patches(dev: torch.device) -> int:
    """Patches per call when the benchmark is not told: the tool's CPU cap, a fixed large pack on CUDA."""
    return CPU_PATCHES if dev.type == "cpu" else 65536


def random_tower(size: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> Tower:
    if SIZES[size].get("unified"):
        return random_unified(SIZES[size], device, dtype)  # no layers: `layers` does not apply
    from ..model.vision import Embedder, VisionConfig, VisionModel
    from .demo import randomize_

    spec = dict(SIZES[size])
    text = spec.pop("text")
    if layers:
        spec["num_hidden_layers"] = layers
    config = VisionConfig.from_dict(spec)
    vision, embed = VisionModel(config), Embedder(config, text)
    randomize_(vision, 0)
    randomize_(embed, 1)
    return Tower(vision.place(device, dtype), embed.to(device=device, dtype=dtype).eval(), device, dtype)


def stock_modules(tower: Tower):
    """The tower's weights in transformers' Gemma4VisionModel and Gemma4MultimodalEmbedder as
    they ship: the hf-padded baseline (the tensors are shared, not copied)."""
    import dataclasses

    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig, Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4MultimodalEmbedder,
        Gemma4VisionModel,
        Gemma4VisionRotaryEmbedding,
    )

    spec = dataclasses.asdict(tower.config)
    theta, _ = spec.pop("rope_theta"), spec.pop("output_proj_dims")
    vcfg = Gemma4VisionConfig(**spec, rope_parameters={"rope_type": "axial", "rope_theta": theta})
    vcfg._attn_implementation = "sdpa"
    text = Gemma4TextConfig(
        hidden_size=tower.out_dim, num_hidden_layers=1, vocab_size=8, vocab_size_per_layer_input=8
    )
    with torch.device("meta"):
        vision, embed = Gemma4VisionModel(vcfg), Gemma4MultimodalEmbedder(vcfg, text)
    vision.load_state_dict(tower.vision.state_dict(), strict=True, assign=True)
    embed.load_state_dict(tower.embed.state_dict(), strict=True, assign=True)
    vision.encoder.rotary_emb = Gemma4VisionRotaryEmbedding(
        vcfg, device=tower.device
    )  # float32, as place() has it
    return vision.eval(), embed.eval()


def random_unified(spec: dict, device: torch.device, dtype: torch.dtype):
    from transformers.models.gemma4_unified.configuration_gemma4_unified import (
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedVisionEmbedder

    from ..model.unified import UnifiedTower
    from .demo import randomize_

    vcfg = Gemma4UnifiedVisionConfig(
        mm_embed_dim=spec["mm_embed_dim"], output_proj_dims=spec["mm_embed_dim"]
    )
    text = Gemma4UnifiedTextConfig(
        hidden_size=spec["text"], num_hidden_layers=1, vocab_size=8, layer_types=["full_attention"]
    )
    embedder = Gemma4UnifiedVisionEmbedder(vcfg, text).eval()
    randomize_(embedder, 0)
    return UnifiedTower(embedder.to(device=device, dtype=dtype).requires_grad_(False), device, dtype)


def tower_layers(tower) -> int:
    return tower.config.num_hidden_layers if tower.attention else 0


def workload(name: str, count: int, seed: int = 0) -> list[Patches]:
    """photos: many aspect ratios at 280 tokens; video: clips × 32 frames at 70; mixed: both."""
    rng = np.random.default_rng(seed)
    ratios = [
        (3, 4),
        (4, 3),
        (1, 1),
        (9, 16),
        (16, 9),
        (2, 3),
        (3, 2),
        (1, 3),
        (3, 1),
        (5, 4),
        (21, 9),
        (4, 5),
    ]

    def image(h, w, budget):
        return patchify(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), budget)

    photos = [image(60 * ratios[i % 12][0], 60 * ratios[i % 12][1], 280) for i in range(count)]
    clips = max(1, count // 32)
    frames = [image(360, 640, 70) for _ in range(clips) for _ in range(32)]
    return {"photos": photos, "video": frames, "mixed": photos[: count // 2] + frames[: count // 2]}[
        name
    ]


class PeakMemory:
    """Peak memory during a call: CUDA's allocator peak, or sampled RSS growth on the CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base, self.running = _rss(), True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.running = False
            self.thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def hf_padded(tower: Tower, items: list[Patches], budget_patches: int, stock=None) -> None:
    """The transformers way: pad every item to the budget, batches of HF_BATCH, masked attention,
    through `stock` (stock_modules(tower): transformers' modules as they ship)."""
    if not tower.attention:
        return hf_padded_unified(tower, items, budget_patches)
    vision, embed = stock
    for i in range(0, len(items), HF_BATCH):
        chunk = items[i : i + HF_BATCH]
        pixels = torch.zeros((len(chunk), budget_patches, 768), dtype=torch.float32)
        positions = torch.full((len(chunk), budget_patches, 2), -1, dtype=torch.long)
        for row, p in enumerate(chunk):
            pixels[row, : p.n] = torch.from_numpy(p.pixels).float() / 255
            positions[row, : p.n] = torch.from_numpy(p.positions)
        with torch.inference_mode():
            out = vision(
                pixel_values=pixels.to(tower.device), pixel_position_ids=positions.to(tower.device)
            )
            embed(out.last_hidden_state)


def hf_padded_unified(tower, items: list[Patches], budget_patches: int) -> None:
    """The transformers way for the unified model: cells padded to the budget, batches of HF_BATCH,
    embed_vision over every row, padding dropped (get_image_features)."""
    from ..model.unified import merge

    cells = budget_patches // (POOL * POOL)
    for i in range(0, len(items), HF_BATCH):
        chunk = [merge(p) for p in items[i : i + HF_BATCH]]
        pixels = torch.zeros(
            (len(chunk), cells, chunk[0][0].shape[1]), dtype=torch.float32
        )  # (B, cells, 6912)
        positions = torch.full((len(chunk), cells, 2), -1, dtype=torch.long)
        for row, (px, pos) in enumerate(chunk):
            pixels[row, : len(px)] = torch.from_numpy(px).float() / 255
            positions[row, : len(pos)] = torch.from_numpy(pos)
        positions = positions.to(tower.device)
        with torch.inference_mode():
            out = tower.embedder(pixels.to(tower.device), positions).pooler_output  # (B, cells, T)
            out[(positions != -1).all(-1)]


def run_ours(tower: Tower, items: list[Patches], mode: str, max_patches: int) -> None:
    units = [Unit(i, 0, p) for i, p in enumerate(items)]
    for batch in batches(units, mode, max_patches):
        tower.encode([u.patches for u in batch], pack=mode == "pack")


def tower_flops(tower: Tower, items: list[Patches]) -> float:
    if not tower.attention:  # per cell: 6912 → D, then D → T
        d, cells = tower.hidden, sum(p.soft_tokens for p in items)
        return 2.0 * cells * (POOL * POOL * 768 * d + d * tower.out_dim)
    c = tower.config
    d, inner, heads, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.head_dim
    kv = c.num_key_value_heads
    total = 0.0
    for p in items:
        n = p.n
        per_layer = (
            2 * n * d * (heads * hd + 2 * kv * hd) + 2 * n * heads * hd * d + 2 * n * 3 * d * inner
        )
        per_layer += 4 * n * n * heads * hd
        total += (
            c.num_hidden_layers * per_layer
            + 2 * n * 768 * d
            + 2 * (n // (POOL * POOL)) * d * tower.out_dim
        )
    return total


@dataclass
class Result:
    method: str
    seconds: float
    items_per_s: float
    patches_per_s: float
    peak_bytes: int
    mfu: float | None = None


def interleaved(
    methods: dict, repeats: int, dev: torch.device, memory_of: torch.device
) -> tuple[dict, dict]:
    """Run every method `repeats` times in rotating order: seconds per run, and peak memory."""
    times = {m: [] for m in methods}
    peaks = {m: 0 for m in methods}
    for r in range(repeats):
        for m in list(methods)[r % len(methods) :] + list(methods)[: r % len(methods)]:
            with PeakMemory(memory_of) as mem:
                start = time.perf_counter()
                methods[m]()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times[m].append(time.perf_counter() - start)
            peaks[m] = max(peaks[m], mem.peak)
    return times, peaks


def bench(
    size="e2b",
    layers=None,
    device="auto",
    dtype="auto",
    workloads=("photos",),
    count=24,
    repeats=3,
    max_patches=None,
    compiled=False,
    log=print,
) -> dict:
    from ..model.batching import measure_memory
    from ..model.load import dtype_name, parse_device, parse_dtype

    dev = parse_device(device)
    dt = parse_dtype(dtype_name(dtype, dev))
    tower = random_tower(size, layers, dev, dt)
    stock = stock_modules(tower) if tower.attention else None
    max_patches = max_patches or default_patches(dev)
    peak = next(
        (v for k, v in PEAK_BF16.items() if dev.type == "cuda" and k in torch.cuda.get_device_name(dev)),
        None,
    )
    report = {
        "size": size,
        "layers": tower_layers(tower),
        "device": str(dev),
        "dtype": str(dt),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "max_batch_patches": max_patches,
        "workloads": {},
    }
    models = {pack: measure_memory(tower, pack) for pack in (False, True)} if dev.type == "cuda" else {}
    fast = copy.copy(tower).compile() if compiled else None  # the same modules, through torch.compile
    log(
        f"{size} tower, {report['layers']} of {SIZES[size]['num_hidden_layers']} layers, {dev}, "
        f"{str(dt).removeprefix('torch.')}, {report['threads']} threads, median of {repeats}"
    )
    for name in workloads:
        items = workload(name, count)
        budget = 2520 if name != "video" else 630
        methods = {
            "hf-padded": lambda: hf_padded(tower, items, max(budget, max(p.n for p in items)), stock),
            **{
                m: (lambda m=m: run_ours(tower, items, m, max_patches))
                for m in ("serial", "bucket", "pack")
            },
        }
        run_ours(tower, items[:2], "pack", max_patches)  # warm-up
        if fast:
            start = time.perf_counter()
            run_ours(fast, items[:1], "serial", max_patches)  # compiles once for every patch count
            report.setdefault("compile_seconds", {})[name] = time.perf_counter() - start
            methods["compiled"] = lambda: run_ours(fast, items, "serial", max_patches)
        times, peaks = interleaved(methods, repeats, dev, dev)
        patches, flops = sum(p.n for p in items), tower_flops(tower, items)
        rows = {}
        for m in methods:
            med = statistics.median(times[m])
            rows[m] = Result(
                m,
                med,
                len(items) / med,
                patches / med,
                peaks[m],
                flops / med / peak if peak and dt == torch.bfloat16 else None,
            ).__dict__
        for m in rows:
            rows[m]["vs_serial"] = rows["serial"]["seconds"] / rows[m]["seconds"]
            rows[m]["vs_hf_padded"] = rows["hf-padded"]["seconds"] / rows[m]["seconds"]
        if (
            dev.type == "cuda"
        ):  # the memory model's prediction for the biggest call, against the measured peak
            for m in ("serial", "bucket", "pack"):
                planned = batches([Unit(i, 0, p) for i, p in enumerate(items)], m, max_patches)
                predicted = max(models[m == "pack"].peak([u.patches.n for u in b]) for b in planned)
                rows[m]["model_peak_bytes"] = predicted
                rows[m]["peak_vs_model"] = rows[m]["peak_bytes"] / predicted
        default = resolve_batching("auto", dev, tower.attention)  # what `encode` runs here unless told
        report["workloads"][name] = {
            "items": len(items),
            "patches": patches,
            "default": default,
            "default_vs_hf_padded": rows[default]["vs_hf_padded"],
            "methods": rows,
        }
        log(table(name, len(items), rows, default))
    return report


def table(name: str, count: int, rows: dict, default: str) -> str:
    lines = [
        f"\n{name}: {count} items (* the default, --batching auto, on this device)",
        f"{'method':<10} {'s':>8} {'items/s':>9} {'patches/s':>11} {'vs serial':>9} {'vs hf':>7} {'peak MB':>9} "
        f"{'/model':>7} {'MFU':>6}",
    ]
    for m, r in rows.items():
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "-"
        vs_model = f"{r['peak_vs_model']:.2f}" if "peak_vs_model" in r else "-"
        shown = m + "*" if m == default else m
        lines.append(
            f"{shown:<10} {r['seconds']:>8.3f} {r['items_per_s']:>9.2f} {r['patches_per_s']:>11,.0f} "
            f"{r['vs_serial']:>9.2f} {r['vs_hf_padded']:>7.2f} {r['peak_bytes'] / 2**20:>9.1f} {vs_model:>7} {mfu:>6}"
        )
    return "\n".join(lines)
