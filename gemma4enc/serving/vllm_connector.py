"""vLLM serves Gemma 4 straight from an OUT: an encoder-cache connector vLLM loads by module path.

    LLM(model=..., ec_transfer_config={
        "ec_connector": "GemmaEncConnector",
        "ec_connector_module_path": "gemma4enc.serving.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"out": "/data/embeddings"},   # or s3://bucket/embeddings
    })

A request whose `multi_modal_uuids` entry is a key of the OUT (cache.py; `gemma4enc.serving.
requests` writes them) gets that file's tokens, read from its shard by byte range: nothing is
copied, nothing is written, the OUT is only read. Any other item (a miss) is left to vLLM's own
encoder. This module is imported by vLLM, inside vLLM's environment: it imports vLLM and
cache.py, nothing else of gemma4enc (whose package import pulls in nothing of either).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.logger import init_logger

from .cache import OutCache

logger = init_logger(__name__)


@dataclass
class GemmaEncMetadata(ECConnectorMetadata):
    keys: list[str] = field(default_factory=list)  # the step's items to load from OUT


class GemmaEncConnector(ECConnectorBase):
    """A read-only consumer: hits come from OUT, misses from vLLM's encoder; it never saves."""

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
        self.dtype = vllm_config.model_config.dtype
        self._cache: OutCache | None = None
        self._pending: list[str] = []
        self.loaded = 0  # items served from OUT by this (worker) connector

    @property
    def cache(self) -> OutCache:
        if self._cache is None:  # on first use: vLLM builds one per role, in its own processes
            self._cache = OutCache(self.out)
            logger.info(
                "gemma4enc: %d files of %s keyed (%d hashed here, %d without a key)",
                len(self._cache.by_key), self.out, self._cache.hashed, len(self._cache.unkeyed),
            )
        return self._cache

    # scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self.cache

    def update_state_after_alloc(self, request, index: int) -> None:
        key = request.mm_features[index].identifier
        if key in self.cache:
            self._pending.append(key)

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
        for key in getattr(meta, "keys", []):
            if key in encoder_cache:
                continue
            encoder_cache[key] = self.cache.tokens(key).to(device=device, dtype=self.dtype)
            self.loaded += 1
            logger.debug("gemma4enc: served %s from %s", key, self.out)

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        return  # read-only: what vLLM encodes itself stays in vLLM
