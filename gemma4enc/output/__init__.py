"""The output folder: shards and the manifest (written and read), its settings, lock, repair,
what is left to do, compaction, and the readers (torch, numpy, Gemma 4, retrieval)."""
