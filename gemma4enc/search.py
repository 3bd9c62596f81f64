"""Nearest files and near-duplicate groups over an output folder's pooled vectors, from Python.

    from gemma4enc.search import Searcher
    with Searcher("embeddings") as index:
        index.nearest("cat.jpg", k=5)      # [(path, score), ...]
"""

from .run.search import Searcher, duplicates, search  # noqa: F401 - the public names
