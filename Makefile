# Two commands on a fresh clone: `make install`, then `make test` (fast) or `make test-all` (everything: CI).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Where no GPU is present the CPU build of torch is installed first, so that the
# plain torch requirement never pulls a multi-GB CUDA build. Override to choose.
TORCH_CPU ?= torch==2.13.0
EXTRAS ?= test,ray
# a second venv with the lowest transformers pyproject.toml allows, for the parity tests
VENV_LOWEST ?= .venv-lowest
LOWEST := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
PARITY := tests/test_tower.py tests/test_model.py tests/test_gemma_client.py tests/test_vision.py

.PHONY: venv install check wheel-check test test-all test-lowest test-torchvision test-vllm bench bench-e2e bench-rss bench-decode bench-video bench-ledger bench-photos bench-fixed demo clean

# a venv with torch: kept where one is installed, else CUDA's where a GPU answers, else the CPU wheel
venv:
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.4"; \
	else \
		$(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi

install: venv
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"

# types where objects meet: the output folder's seam, the Ray driver, the in-memory encoder and the
# local engine, the video decoder; 0 errors (pyproject's [tool.mypy])
check:
	$(PY) -m mypy gemma4enc/output gemma4enc/run/ray gemma4enc/run/encoder.py gemma4enc/run/local.py \
		gemma4enc/media/video.py gemma4enc/media/videoindex.py gemma4enc/media/mpegts.py

# what `pip install .` ships, as a user gets it: the sdist and the wheel built, the wheel (not
# editable) installed into a fresh venv, then run from outside the checkout: --version, demo, encode, verify
VENV_WHEEL ?= .venv-wheel
wheel-check:
	rm -rf dist $(VENV_WHEEL) .wheel-run .wheel-src
	# from a copy of the tracked files: a stale egg-info or build/ here could fill a gap in the package list
	mkdir .wheel-src && git ls-files -z | xargs -0 cp --parents -t .wheel-src
	$(PY) -m build --no-isolation -o dist .wheel-src >/dev/null  # the sdist, then the wheel from it
	$(MAKE) venv VENV=$(VENV_WHEEL) PYTHON=$(PYTHON)
	$(VENV_WHEEL)/bin/python -m pip install -q dist/*.whl
	mkdir -p .wheel-run && cd .wheel-run && \
		../$(VENV_WHEEL)/bin/gemma4enc --version && \
		../$(VENV_WHEEL)/bin/gemma4enc demo demo >/dev/null && \
		../$(VENV_WHEEL)/bin/gemma4enc encode demo/media -o out --model demo/tiny-gemma4 --dtype float32 --device cpu -q && \
		../$(VENV_WHEEL)/bin/gemma4enc verify out
	@echo "wheel-check: the installed wheel encodes and verifies"

# the fast default leaves out the tests marked slow (Ray clusters, a store going down, kill -9 loops,
# the benchmarks' own runs, real-size towers: ~10 of ~14 minutes on 2 cores), one worker process per
# core (pytest-xdist: 4 min 12 s on 2 quiet cores, 6 min 32 s in one process); test-all runs everything
test:
	$(PY) -m pytest -q -n auto -m "not slow" tests

test-all:
	$(PY) -m pytest -q tests

# the parity tests (every path against get_image_features / get_video_features, and Gemma 4 fed
# from the shards) on the lowest transformers we claim
test-lowest:
	$(MAKE) install VENV=$(VENV_LOWEST) EXTRAS=test
	$(VENV_LOWEST)/bin/python -m pip install -q "transformers==$(LOWEST)"
	$(VENV_LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(PARITY)

# --resize torchvision against transformers' torchvision processors, in a venv of its own: PyPI's
# torchvision does not load beside the CPU torch of $(VENV), so this one takes a torch and a
# torchvision that load together (a CUDA build, several GB; `pip install torch==2.9.1
# torchvision==0.24.1` is a CPU build on aarch64). Run from the checkout, not an installed copy.
VENV_TV ?= .venv-torchvision
TORCH_TV ?= torch==2.14.1 torchvision==0.29.1
test-torchvision:
	test -x $(VENV_TV)/bin/python || $(PYTHON) -m venv $(VENV_TV)
	$(VENV_TV)/bin/python -m pip install -q $(TORCH_TV)
	$(VENV_TV)/bin/python -m pip install -q . pytest
	PYTHONPATH=$(CURDIR) $(VENV_TV)/bin/python -m pytest -q -p no:cacheprovider tests/test_torchvision_pixels.py

# vLLM's CPU build serving from gemma4enc's tokens: its venv in ~/.cache/gemma4enc-vllm (minutes, 3.5 GB
# the first time), then generation from the tokens against generation from pixels (docs/serving.md)
test-vllm:
	PYTHON=$(PY) scripts/vllm_check.sh

bench:
	$(PY) -m gemma4enc bench --device cpu --layers 2 --items 12 --workload photos --workload video --workload mixed --json bench-out/bench.json

# real-size media (generated once into ~/.cache/gemma4enc/bench-media/v<VERSION>) or DIR=folder: decode per core, cores to feed, overlap
bench-e2e:
	$(PY) -m gemma4enc bench --e2e $(DIR) --device cpu --layers 2 --json bench-out/e2e.json

# does host memory grow with the folder? peak RSS of encode over 500 and 5,000 files (a developer check)
bench-rss:
	$(PY) benchmarks/rss.py --items 500 --json bench-out/rss.json

# re-runs over 100 k and 1 M files that are mostly done (no-op, 1 % changed, inspect, verify, compact)
bench-photos:
	$(PY) benchmarks/photos_e2e.py --photos 14 --layers 2 --rounds 2 --json bench-out/photos_e2e.json

# a run's fixed cost: 1, N and 2N photos in fresh processes, interleaved; the ratio N / (2N - N), the
# transformers loop beside it, the overlap (bench --e2e) and where the time before the first photo went
bench-fixed:
	$(PY) benchmarks/fixed_cost.py --photos 14 --layers 2 --rounds 2 --json bench-out/fixed_cost.json

bench-ledger:
	$(PY) benchmarks/ledger.py --n 100000 --n 1000000 --changed-up-to 100000 --json bench-out/ledger.json
	$(PY) benchmarks/ledger.py --startup --json bench-out/startup.json

# decode to patches per core on real-size media (generated once into ~/.cache), or DIR=folder: a sample of yours
bench-decode:
	$(PY) benchmarks/decode.py $(DIR) --json bench-out/decode.json

demo:
	$(PY) -m gemma4enc demo ./demo

clean:
	rm -rf $(VENV) $(VENV_LOWEST) $(VENV_WHEEL) $(VENV_TV) .wheel-run .wheel-src dist demo bench-out *.egg-info

bench-video:
	$(PY) benchmarks/video_decode.py
