"""What `pip install .` ships, and the Python it claims: the wheel holds every module of the
checkout, and no construct needs a Python newer than requires-python."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked(folder: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True)
    return sorted(out.stdout.split())


def test_the_wheel_holds_every_tracked_module(tmp_path):
    pytest.importorskip("build")
    # built from a copy of the tracked files, as a clean clone would: a checkout's stale
    # gemma4enc.egg-info or build/ folder would fill the gaps a wrong package list leaves
    src = tmp_path / "src"
    for name in _tracked("."):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("gemma4enc-*.whl")  # built from the unpacked sdist
    shipped = sorted(n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("gemma4enc/"))
    assert shipped == _tracked("gemma4enc")


def _floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'requires-python\s*=\s*">=\s*(3\.\d+)"', text).group(1)


def test_the_declared_floor_is_the_one_in_the_readme_and_the_classifiers():
    floor = _floor()
    assert f"Python ≥ {floor}" in (ROOT / "README.md").read_text()
    assert f'"Programming Language :: Python :: {floor}"' in (ROOT / "pyproject.toml").read_text()


def test_no_construct_needs_a_python_newer_than_the_floor(tmp_path):
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    if vermin is None:
        pytest.skip("vermin is not installed (pip install '.[test]')")
    run = subprocess.run([vermin, f"-t={_floor()}-", "--violations", "--no-tips", "--eval-annotations",
                          "gemma4enc", "tests", "benchmarks", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
