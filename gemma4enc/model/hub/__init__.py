"""Fetch only a hub checkpoint's vision tensors: its config, each safetensors header (by HTTP
Range requests) and the byte ranges of `vision_tower.*` / `embed_vision.*` (`vision_embedder.*`
for gemma4_unified), kept as a vision-only checkpoint folder in a cache keyed by repo and commit.

E2B ships one ~10 GB `model.safetensors` for ~0.35 GB of vision; 31B's vision sits in a ~50 GB
shard. Everything goes through huggingface_hub's own client (its endpoint, HF_ENDPOINT, token,
gated-repo errors, offline switch and session), so what works for `hf download` works here.

The cached folder (`cache_root()/<org>--<name>/<commit>/`) holds config.json (+ the processor
configs), a `model.safetensors` with only the vision tensors, and `fetch.json` (what was fetched,
written last: a folder without it is unfinished). Until then the weights grow in
`model.safetensors.part` with `model.safetensors.part.json` recording how far each range got,
so a cut connection or a killed run resumes with only the missing bytes.

Names without an underscore in the modules are what fetch.py takes from its siblings (the
subpackage's own API); what the rest of the package may use is imported here.
"""

from .cache import cache_root, repo_folder  # noqa: F401 - the subpackage's face
from .fetch import cache_only, config_file, fetch, hub_files  # noqa: F401
