"""Developer tools that ship as commands: demo media and checkpoints, bench and bench --e2e."""
