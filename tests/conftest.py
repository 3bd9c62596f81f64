"""Shared fixtures: tiny random checkpoints (saved by transformers), their reference models, test media.

Plain functions the tests share are in helpers.py. A test marked `cuda` is skipped, with the
reason, where no CUDA device is present (scripts/gpu_check.sh runs them on a GPU machine).
"""

from __future__ import annotations

import os

import pytest
import torch

from gemma4enc.dev import demo

from .corpus import good_media
from .helpers import SHAPES, photo, reference

# one intra-op thread whatever the machine: what a test computes, and how long it takes, does not
# depend on the cores it finds, and the decode worker processes a test starts keep theirs. The
# processes a test starts (`gemma4enc encode` in a subprocess, Ray's workers) get one too, through
# the environment: on some CPUs (an Intel Xeon with AMX, seen here) the tower's float32 sums over
# two threads differ in the last bit from one thread's, and tests compare such runs bit for bit
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked cuda; torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """E2B-like: clipped linears, one model.safetensors."""
    folder = tmp_path_factory.mktemp("ckpt-single")
    demo.build(folder, seed=1, clipped=True, standardize=False)
    return folder


@pytest.fixture(scope="session")
def ckpt_sharded(tmp_path_factory):
    """26B-like: standardize (std_bias/std_scale), sharded with an index."""
    folder = tmp_path_factory.mktemp("ckpt-sharded")
    demo.build(folder, seed=2, clipped=True, standardize=True, shard_size="200KB")
    return folder


@pytest.fixture(scope="session")
def ckpt_unified(tmp_path_factory):
    """12B-like (gemma4_unified: an encoder-free embedder, no ViT), sharded with an index."""
    folder = tmp_path_factory.mktemp("ckpt-unified")
    demo.build(folder, seed=3, unified=True, shard_size="300KB")
    return folder


@pytest.fixture(scope="session")
def ref_sharded(ckpt_sharded):
    return reference(ckpt_sharded)


@pytest.fixture(scope="session")
def photos():
    return [photo(h, w, seed=i) for i, (h, w) in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def contract_s3(request):
    """A loopback S3 (moto) and a bucket of the module's own (moto's state is the process's), for a
    module's backend contract tests: (filesystem, bucket)."""
    pytest.importorskip("moto.server")
    from .helpers import loopback_s3

    bucket = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    with loopback_s3(bucket) as (fs, _):
        yield fs, bucket


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Six valid photos and clips (corpus.good_media), made once per module."""
    return good_media(tmp_path_factory.mktemp("good") / "media")


@pytest.fixture
def bounded():
    """A Ray test that can never hang the suite: past GEMMA4ENC_TEST_BOUND_S (1,800 s: a two-node
    test took 6 min at load 30) the process prints every thread's stack and exits (faulthandler's
    watchdog is a C thread: it fires even while the test waits inside Ray's C++ code)."""
    import faulthandler
    import os

    faulthandler.dump_traceback_later(float(os.environ.get("GEMMA4ENC_TEST_BOUND_S") or 1800), exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
