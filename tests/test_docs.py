"""The docs that are generated from the code are up to date, name one option reference and link to what exists."""

import importlib.util
import re
from collections.abc import Iterator
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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
OPTION_ROW = re.compile(r"^\|\s*`(--?[\w-]+)")  # a table row whose first cell starts with an option
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _cli_options() -> set[str]:
    """Every option name of every command, from the CLI itself."""
    import typer.main

    from gemma4enc.commands.cli import app

    names = {"--help", "-h", "--version"}
    for command in typer.main.get_command(app).commands.values():
        for param in command.params:
            names.update(getattr(param, "opts", ()))
            names.update(getattr(param, "secondary_opts", ()))
    return names


def test_options_have_one_reference():
    """docs/cli.md is the option reference. commands.md is a guide: it holds no option table, and
    every option it or the README names exists (a renamed option cannot linger there). The README's
    short table of the options people change names each option once."""
    options = _cli_options()
    readme_rows: list[str] = []
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        if doc.name == "cli.md":
            continue
        rows = [line for line in doc.read_text().splitlines() if OPTION_ROW.match(line)]
        if doc.name == "README.md":
            readme_rows = rows
        else:
            assert not rows, f"{doc.name} has an option table (options belong in docs/cli.md): {rows[0][:60]}"
    named = [opt for row in readme_rows for opt in OPTION.findall(row.split("|")[1])]
    assert len(named) == len(set(named)), f"an option has two rows in README.md's table: {sorted(named)}"
    others = {"--index-url"}  # pip's, in the README's install section
    for doc in (ROOT / "README.md", ROOT / "docs" / "commands.md"):
        unknown = set(OPTION.findall(doc.read_text())) - options - others
        assert not unknown, f"{doc.name} names options gemma4enc does not have: {sorted(unknown)}"


def _anchors(doc: Path) -> Iterator[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1 on repeats."""
    seen: dict[str, int] = {}
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_links_between_docs_lead_somewhere():
    """Every relative link in README.md and docs/ names a file that exists and, with #part, one of
    its headings (a section moved to docs/benchmarks/ or renamed breaks this)."""
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor:
                assert anchor in set(_anchors(dest)), f"{doc.relative_to(ROOT)}: no heading #{anchor} in {path or doc.name}"
