"""Trustworthy from cron (issue 15): nothing touched that is not ours, settings remembered truly,
re-runs that heal, a log a person can read. Every case goes through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemma4enc.cli import app

from .conftest import photo
from .test_cli import BASE, encode

RUN = CliRunner()


@pytest.fixture(scope="module")
def pics(tmp_path_factory):
    """Three small photos: enough for a run that takes a second."""
    root = tmp_path_factory.mktemp("pics") / "media"
    root.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80), (48, 120)]):
        photo(h, w, seed=i).save(root / f"p{i}.png")
    return root


def rows_of(out: Path) -> dict[str, dict]:
    rows = {}
    for line in (out / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["path"]] = row
    return rows


def test_only_our_temp_files_are_removed(pics, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".draft.tmp").write_text("the user's")
    (out / "notes.tmp").write_text("the user's too")
    ours = [".gemma4enc-shard-000003.safetensors.4242.tmp", ".shard-000003.safetensors.4242.tmp",
            ".manifest.jsonl.77.tmp", ".write-test-5.tmp"]  # ours now, and the names earlier versions used
    for name in ours:
        (out / name).write_bytes(b"half")
    result = encode([pics, "-o", out, "--model", ckpt, *BASE])
    assert result.exit_code == 0, result.output
    assert not any((out / name).exists() for name in ours)
    report = json.loads(RUN.invoke(app, ["verify", str(out), "--json"]).stdout)
    assert report["ok"] and not report["warnings"]
    result = encode([pics, "-o", out, "--model", ckpt, *BASE, "--overwrite"])
    assert result.exit_code == 0 and json.loads(result.stdout)["encoded"] == 3
    assert (out / ".draft.tmp").read_text() == "the user's" and (out / "notes.tmp").read_text() == "the user's too"
