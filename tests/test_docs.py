"""The docs that are generated from the code are up to date."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cli_docs():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_every_commands_help():
    cli_docs = _cli_docs()
    rendered = cli_docs.render()
    assert "## `gemma4enc encode`" in rendered and "--max-soft-tokens" in rendered
    assert cli_docs.DOC.read_text() == rendered, "docs/cli.md is stale: run python scripts/cli_docs.py"
