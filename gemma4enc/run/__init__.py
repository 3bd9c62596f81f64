"""One run: preflight, the lock, what is left to do, the engine (local or Ray) and the pipeline
that wires decode workers, the tower and the shard writer window by window."""
