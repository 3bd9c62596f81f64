"""Serving Gemma 4 from an OUT: vLLM's encoder-cache layout (export.py), a connector vLLM loads by
module path (vllm_connector.py), request dicts (requests.py), and the key scheme they share
(cache.py). Importing this package imports none of them, and nothing of vLLM."""
