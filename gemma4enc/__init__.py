"""gemma4enc: encode folders of images and videos with the Gemma 4 vision tower.

import gemma4enc
emb = gemma4enc.open("embeddings")      # reads only the manifest
tokens = emb["/data/cat.jpg"]           # (soft tokens, hidden) from one shard
"""

from ._version import __version__  # noqa: F401 - the public name


def open(out, framework: str = "pt"):  # noqa: A001 - the reader's natural name, as in safetensors.safe_open
    """An output folder's reader: `emb[path]`, `emb.frames(path)`, `emb.pooled(path)`, `emb.row(path)`,
    `emb.mm_encoder_outputs(paths, model=…)` for Gemma 4, `emb.pooled_matrix()` for search.

    framework="pt": torch tensors in the stored dtype; "numpy": float32 numpy arrays (lookups, frames,
    pooled), no torch needed. `out` may be a URL (s3://…): its manifest is read into a temp folder,
    each shard fetched when first read, all removed when the reader is."""
    if framework not in ("pt", "numpy"):
        raise ValueError(f"framework {framework!r}: use 'pt' or 'numpy'")
    if framework == "numpy":
        from .output.npreader import NumpyEmbeddings as reader
    else:
        from .output.reader import Embeddings as reader
    from .media.remote import is_url

    if not is_url(str(out)):
        return reader(out)
    import weakref

    from .output.mirror import Mirror

    from .errors import OutputError
    from .output.store import SAVED

    mirror = Mirror(str(out))
    try:
        try:
            mirror.pull()
        except OutputError as e:  # keys, endpoint, a store down: said without a run's advice
            raise OutputError(str(e).removesuffix(SAVED)) from None
        if not mirror.found:
            from .output.files import not_an_output

            raise FileNotFoundError(not_an_output(mirror.url))
        emb = reader(mirror.path)
    except BaseException:
        mirror.close()
        raise
    weakref.finalize(emb, mirror.close)
    emb.url = mirror.url
    return emb
