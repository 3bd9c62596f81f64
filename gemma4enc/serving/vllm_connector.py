"""vLLM serves Gemma 4 straight from an OUT: an encoder-cache connector vLLM loads by module path.

    LLM(model=..., ec_transfer_config={
        "ec_connector": "GemmaEncConnector",
        "ec_connector_module_path": "gemma4enc.serving.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"out": "/data/embeddings"},   # or s3://bucket/embeddings
    })

A request whose `multi_modal_uuids` entry is a key of the OUT (cache.py; `gemma4enc.serving.
requests` writes them) gets that file's tokens, read from its shard by byte range: nothing is
copied, nothing is written, the OUT is only read. This module is imported by vLLM, inside vLLM's
environment: it imports vLLM and cache.py, nothing else of gemma4enc (whose package import pulls
in nothing of either).

No silent miss. vLLM hashes a client's uuid together with the modality's media_io_kwargs (the
server's `--media-io-kwargs`, or a request's) and a request's mm_processor_kwargs: the identifier
the connector is asked about is then not our key. For the server-wide media_io_kwargs, which the
connector sees in vLLM's config, it computes that same hash for every key once, at start, and
answers those identifiers from OUT too. An identifier it cannot map (per-request kwargs, a key OUT
lacks) is a miss: vLLM's encoder runs on the request's pixels, which is right where they are the
file's own pixels. Where they are a stand-in (`requests.stand_in`: every pixel MARK, a colour no
photo is made of), an answer would come from it, so the scheduler fails that request instead
(vLLM's `take_unavailable_requests`: FINISHED_ERROR, a loud error to the client) and says why in
the server's log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.logger import init_logger

from .cache import STAND_IN, OutCache

# under vllm.: vLLM's own logging configuration shows it (a logger outside `vllm.` printed nothing
# in the server's log, not even the start-up line)
logger = init_logger("vllm.gemma4enc")

MARK = STAND_IN  # the stand-in's colour (requests.py): a flat image of it is no real file's
STATS_S = 60.0  # a line of hits, misses and refusals at most this often


COUNTS = ("hits", "misses", "refused")


@dataclass
class GemmaEncStats(ECConnectorStats):
    """The scheduler's lookups since the last report: vLLM logs them ("EC Transfer metrics: hits=…")
    and its Prometheus logger counts them (GemmaEncPromMetrics), as it does for its own connectors."""

    def __post_init__(self):
        for name in COUNTS:
            self.data.setdefault(name, 0)

    def reset(self):
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for name in COUNTS:
            self.data[name] = self.data.get(name, 0) + int((other.data or {}).get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in COUNTS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTS)


class GemmaEncPromMetrics(ECConnectorPromMetrics):
    """vllm:gemma4enc_hits_total, _misses_total and _refused_total on the server's /metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        said = {"hits": "items answered from the OUT (the encoder not run)",
                "misses": "items vLLM encoded itself (no key of the OUT)",
                "refused": "requests failed: a stand-in no key of the OUT answers"}
        self.counters = {}
        for name in COUNTS:
            counter = self._counter_cls(name=f"vllm:gemma4enc_{name}", documentation=f"gemma4enc: {said[name]}",
                                        labelnames=labelnames)
            self.counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name in COUNTS:
            n = int((transfer_stats_data or {}).get(name, 0))
            if n and engine_idx in self.counters[name]:
                self.counters[name][engine_idx].inc(n)


@dataclass
class GemmaEncMetadata(ECConnectorMetadata):
    # the step's items to load from OUT: (vLLM's identifier, OUT's key)
    keys: list[tuple[str, str]] = field(default_factory=list)


def is_stand_in(feature) -> bool:
    """Whether a request's item is a stand-in (its processed pixels all MARK, padding aside)."""
    import torch

    data = getattr(feature, "data", None)
    if data is None:
        return False
    for name in ("pixel_values", "pixel_values_videos"):
        elem = data.get(name) if hasattr(data, "get") else None
        if elem is None:
            continue
        values = getattr(elem, "data", elem)
        tensors = values if isinstance(values, (list, tuple)) else [values]
        mark = torch.tensor(MARK, dtype=torch.float32) / 255
        for t in tensors:
            rows = t.detach().float().reshape(-1, 3)
            marked = (rows - mark).abs().max(dim=1).values < 0.5 / 255
            padding = (rows == rows[-1]).all(dim=1) & ~marked if len(rows) else marked
            if not len(rows) or not marked.any() or not (marked | padding).all():
                return False
        return True
    return False


class GemmaEncConnector(ECConnectorBase):
    """A read-only consumer: hits come from OUT, misses from vLLM's encoder (a stand-in's: refused)."""

    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        if transfer is None:
            raise ValueError("GemmaEncConnector needs ec_transfer_config")
        self.out = transfer.get_from_extra_config("out", None)
        if not self.out:
            raise ValueError('GemmaEncConnector: set ec_connector_extra_config={"out": OUT} (a folder or URL)')
        if self.is_producer:
            raise ValueError("GemmaEncConnector only reads an OUT: use ec_role ec_consumer")
        self.vllm_config = vllm_config
        self.dtype = vllm_config.model_config.dtype
        self._cache: OutCache | None = None
        self._aliases: dict[str, str] = {}  # vLLM's hashed identifier → OUT's key
        self._pending: list[tuple[str, str]] = []
        self._refused: set[str] = set()  # request ids whose stand-in no key answers
        self.loaded = 0  # items served from OUT by this (worker) connector
        self.counts = dict.fromkeys(COUNTS, 0)  # since start: the minute's log line
        self._interval = GemmaEncStats()  # since vLLM last asked: its stats and metrics
        self._said = time.monotonic()

    @property
    def cache(self) -> OutCache:
        if self._cache is None:  # on first use: vLLM builds one per role, in its own processes
            self._cache = OutCache(self.out)
            self._aliases = self._hashed_aliases()
            logger.info(
                "gemma4enc: serving %s: %d files keyed (%d hashed here, %d without a key), "
                "%d identifiers of the server's media_io_kwargs mapped", self.out, len(self._cache.by_key),
                self._cache.hashed, len(self._cache.unkeyed), len(self._aliases),
            )
        return self._cache

    def _hashed_aliases(self) -> dict[str, str]:
        """vLLM's identifier of every key under the server-wide media_io_kwargs → the key, computed
        as vLLM computes it (vllm/multimodal/processing/inputs.py: get_mm_hashes)."""
        model_config = self.vllm_config.model_config
        mm = getattr(model_config, "multimodal_config", None)
        kwargs = dict(getattr(mm, "media_io_kwargs", None) or {})
        if not any(kwargs.get(k) for k in ("image", "video")):
            return {}
        from vllm.multimodal.hasher import MultiModalHasher

        algorithm, model_id = mm.mm_hasher_algorithm, model_config.model
        aliases = {}
        for key, entry in self._cache.by_key.items():
            modality = entry.row.get("kind")
            scoped = kwargs.get(modality)
            if scoped:
                hashed = MultiModalHasher.hash_kwargs(algorithm, model_id=model_id, **{modality: key},
                                                      media_io_kwargs={modality: scoped})
                aliases[hashed] = key
        return aliases

    def key_of(self, identifier: str) -> str | None:
        """OUT's key for vLLM's identifier: itself, or the key it hashes from; None: a miss."""
        cache = self.cache
        if identifier in cache:
            return identifier
        return self._aliases.get(identifier)

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        self._interval.data[what] += 1
        now = time.monotonic()
        if now - self._said >= STATS_S:
            self._said = now
            logger.info("gemma4enc: %s: %d hits, %d misses (vLLM encoded them), %d stand-ins refused",
                        self.out, self.counts["hits"], self.counts["misses"], self.counts["refused"])

    # stats: vLLM asks the scheduler's connector after each step

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self._interval.is_empty():
            return None
        stats, self._interval = self._interval, GemmaEncStats()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return GemmaEncStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return GemmaEncPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        found = self.key_of(identifier) is not None
        self._count("hits" if found else "misses")
        return found

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        """A request whose stand-in no key answers is failed (take_unavailable_requests), never
        answered from the stand-in; it is not held back, so the scheduler fails it at this step."""
        for feature in request.mm_features or []:
            if request.request_id in self._refused:
                break
            if self.key_of(feature.identifier) is None and is_stand_in(feature):
                self._refused.add(request.request_id)
                self._count("refused")
                logger.warning(
                    "gemma4enc: request %s carries a stand-in %s whose identifier %s is no key of %s "
                    "(per-request media_io_kwargs or mm_processor_kwargs, or a file OUT lacks): failed, "
                    "not answered from the stand-in", request.request_id, feature.modality,
                    feature.identifier, self.out,
                )
        return True

    def take_unavailable_requests(self) -> set[str]:
        refused, self._refused = self._refused, set()
        return refused

    def update_state_after_alloc(self, request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        key = self.key_of(identifier)
        if key is not None:
            self._pending.append((identifier, key))

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        meta, self._pending = GemmaEncMetadata(keys=self._pending), []
        return meta

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for identifier, key in getattr(meta, "keys", []):
            if identifier in encoder_cache:
                continue
            encoder_cache[identifier] = self.cache.tokens(key).to(device=device, dtype=self.dtype)
            self.loaded += 1
            logger.debug("gemma4enc: served %s (key %s) from %s", identifier, key, self.out)

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        return  # read-only: what vLLM encodes itself stays in vLLM
