"""The command line (cli), the read-only reports (plan, inspect, verify) and what a person reads (log)."""
