"""The Gemma 4 and retrieval snippets of README.md, docs/gemma.md and docs/search.md run as written, against a tiny full checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gemma4enc.commands.cli import app
from gemma4enc.dev.demo import write_video

from . import gemma_client as gc
from .helpers import photo

ROOT = Path(__file__).parents[1]
README, GEMMA, SEARCH = ROOT / "README.md", ROOT / "docs" / "gemma.md", ROOT / "docs" / "search.md"


def snippet(marker: str, doc: Path = README) -> str:
    found = re.search(rf"<!-- tested: {marker} -->\n```python\n(.*?)\n```", doc.read_text(), re.S)
    assert found, f"no '<!-- tested: {marker} -->' code block in {doc.name}"
    return found.group(1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """What the snippets assume: the checkpoint they name, media/ and its encoded embeddings/."""
    root = tmp_path_factory.mktemp("readme")
    gc.build(root / "google" / "gemma-4-E2B-it", "e2b", seed=5)  # a local folder shadows the hub id
    (root / "media").mkdir()
    photo(240, 320, seed=1).save(root / "media" / "cat.jpg")
    photo(320, 240, seed=2).save(root / "media" / "dog.jpg")
    write_video(root / "media" / "clip.mp4", frames=24)
    return root


def test_gemma_and_retrieval_snippets(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    result = CliRunner().invoke(app, ["encode", "media", "-o", "embeddings", "--model", "google/gemma-4-E2B-it",
                                      "--device", "cpu", "--workers", "0", "--frames", "3", "-q"])
    assert result.exit_code == 0, result.output
    short: dict = {}
    exec(compile(snippet("gemma"), "README.md:gemma", "exec"), short)
    assert short["out"].shape[1] == short["batch"]["input_ids"].shape[1] + 20
    gemma: dict = {}
    exec(compile(snippet("splice", GEMMA), "docs/gemma.md:splice", "exec"), gemma)
    batch, out, model = gemma["batch"], gemma["out"], gemma["model"]
    assert out.shape[1] == batch["input_ids"].shape[1] + 20
    with torch.no_grad():
        want = model(**batch).logits
    assert torch.equal(gemma["logits"], want)  # the splice is the same forward
    found: dict = {}
    exec(compile(snippet("retrieval", SEARCH), "docs/search.md:retrieval", "exec"), found)
    assert found["paths"][found["top"][0]].endswith("media/cat.jpg") and found["scores"].max() == pytest.approx(1)
    assert len(found["keys"]) == 2 + 3 and found["frames"].shape == (5, found["vectors"].shape[1])
    assert "media/cat.jpg" in capsys.readouterr().out
    searcher: dict = {}
    exec(compile(snippet("searcher", SEARCH), "docs/search.md:searcher", "exec"), searcher)
    assert searcher["nearest"][0][1] == pytest.approx(1, abs=2e-3)
    first = capsys.readouterr().out.splitlines()[0].split()
    assert first[0] == "1.000" and first[1].endswith("media/cat.jpg")
