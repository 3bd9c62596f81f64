"""Where a run's files are encoded: `local` (this process and its decode workers) or `ray`."""
