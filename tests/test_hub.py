"""Vision bytes only from the hub (issue 17, item 1), against a hub emulator on loopback
(tests/hub_server.py) that huggingface_hub reaches through HF_ENDPOINT and that counts what it serves."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import gemma4enc
from gemma4enc.commands.cli import app
from gemma4enc.errors import UsageError
from gemma4enc.model import hub as hub_mod
from gemma4enc.model.checkpoint import find_checkpoint
from gemma4enc.model.hub import ranges as hub_ranges

from .helpers import BASE, RUN, encode, photo
from .hub_server import HubServer, build_checkpoint, headers_and_vision

REPO = "acme/tiny-gemma4"
COMMIT, COMMIT2 = "1" * 40, "2" * 40


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub-ckpt")
    build_checkpoint(folder, seed=5)
    return folder


@pytest.fixture(scope="module")
def sharded2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub-ckpt2")
    build_checkpoint(folder, seed=6)
    return folder


@pytest.fixture
def serve(tmp_path, monkeypatch, sharded):
    """serve(ranges=True) → a running emulator holding REPO@COMMIT, with huggingface_hub pointed at it."""
    from huggingface_hub import constants

    @contextmanager
    def start(ranges: bool = True, api: bool = True):
        with HubServer(ranges=ranges, api=api) as server:
            server.add(REPO, sharded, COMMIT)
            monkeypatch.setenv("HF_ENDPOINT", server.url)
            monkeypatch.setattr(constants, "ENDPOINT", server.url)
            monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                                server.url + "/{repo_id}/resolve/{revision}/{filename}")
            yield server

    monkeypatch.setenv("GEMMA4ENC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # no full snapshot of the user's
    go_offline(monkeypatch, False)
    return start


def go_offline(monkeypatch, on: bool) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if on else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", on)


def fetched_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_first_fetch_moves_only_the_vision_bytes(serve, sharded):
    from transformers import Gemma4ForConditionalGeneration

    header_bytes, vision_bytes, original = headers_and_vision(sharded)
    total = sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
    assert len(list(sharded.glob("*.safetensors"))) >= 2 and vision_bytes < total / 4  # the LM holds most bytes
    with serve() as server:
        report = hub_mod.fetch(REPO)
        assert server.weight_bytes() <= (vision_bytes + header_bytes) * 1.05, (server.served, vision_bytes)
    folder = Path(report["folder"])
    assert report["commit"] == COMMIT and folder == Path(hub_mod.cache_root()) / "acme--tiny-gemma4" / COMMIT
    assert report["tensors"] == len(original) and report["vision_bytes"] == vision_bytes
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "fetch.json", "model.safetensors"]
    got = fetched_tensors(folder)
    assert_same(got, original)
    state = Gemma4ForConditionalGeneration.from_pretrained(sharded, dtype=torch.float32).state_dict()
    assert_same(got, {k: state[k] for k in original})
    ckpt = find_checkpoint(REPO)  # served from the cache, at the commit
    assert ckpt.root == folder and ckpt.revision == COMMIT


def test_encode_through_the_hub_equals_the_local_folder_and_a_second_run_fetches_nothing(serve, sharded, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    with serve() as server:
        remote = encode([media, "-o", tmp_path / "remote", "--model", REPO, *BASE])
        assert remote.exit_code == 0, remote.output
        assert server.weight_bytes() > 0
        server.reset()
        again = RUN.invoke(app, ["fetch", REPO, "--json"])
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout)["cached"] and server.weight_bytes() == 0
        assert {path for _, path, _ in server.requests} == {f"/api/models/{REPO}"}  # only the commit is asked
    local = encode([media, "-o", tmp_path / "local", "--model", sharded, *BASE])
    assert local.exit_code == 0, local.output
    a, b = gemma4enc.open(tmp_path / "remote"), gemma4enc.open(tmp_path / "local")
    for i in range(2):
        path = str(media / f"p{i}.png")
        assert torch.equal(a[path], b[path])


def test_fetch_lines_keep_to_quiet_and_go_to_the_log_file(serve, tmp_path):
    media, log = tmp_path / "media", tmp_path / "run.log"
    media.mkdir()
    photo(64, 96).save(media / "p.png")
    with serve():
        quiet = encode([media, "-o", tmp_path / "out", "--model", REPO, *BASE, "--log-file", log])
    assert quiet.exit_code == 0, quiet.output
    assert "fetching" not in quiet.stderr and "fetching" in log.read_text()


def test_revision_pins_a_commit_and_a_rerun_keeps_the_recorded_one_when_main_moves(serve, sharded, sharded2, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    photo(64, 96).save(media / "p0.png")
    out = tmp_path / "out"
    with serve() as server:
        first = encode([media, "-o", out, "--model", REPO, *BASE])
        assert first.exit_code == 0, first.output
        assert json.loads((out / "settings.json").read_text())["revision"] == COMMIT
        server.add(REPO, sharded2, COMMIT2)  # main moves on
        server.reset()
        photo(80, 80, seed=1).save(media / "p1.png")
        again = encode([media, "-o", out, "--model", REPO, *BASE])  # no --revision: the recorded commit
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout)["encoded"] == 1
        assert server.requests == []  # a cached commit needs no question to the hub
        moved = encode([media, "-o", out, "--model", REPO, "--revision", "main", *BASE])
        assert moved.exit_code == 2 and f"revision: '{COMMIT}' → '{COMMIT2}'" in moved.stderr, moved.output
        pinned = encode([media, "-o", tmp_path / "pinned", "--model", REPO, "--revision", COMMIT, *BASE])
        assert pinned.exit_code == 0, pinned.output
    old = encode([media, "-o", tmp_path / "local", "--model", sharded, *BASE])
    new = encode([media, "-o", tmp_path / "local2", "--model", sharded2, *BASE])
    assert old.exit_code == new.exit_code == 0
    a, b, c = (gemma4enc.open(tmp_path / d) for d in ("out", "local", "pinned"))
    for name in ("p0.png", "p1.png"):
        path = str(media / name)
        assert torch.equal(a[path], b[path]) and torch.equal(c[path], b[path])  # COMMIT's weights throughout
    assert not torch.equal(a[path], gemma4enc.open(tmp_path / "local2")[path])  # COMMIT2's differ


def test_plan_with_a_hub_id_reads_its_config_alone(serve, sharded, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    photo(64, 96).save(media / "p0.png")
    width = json.loads((sharded / "config.json").read_text())["text_config"]["hidden_size"]
    given = RUN.invoke(app, ["plan", str(media), "--hidden-size", str(width), "--json"])
    with serve() as server:
        planned = RUN.invoke(app, ["plan", str(media), "--model", REPO, "--json"])
        assert planned.exit_code == 0, planned.output
        assert server.weight_bytes() == 0  # no vision tensor moved for a dry run
    assert json.loads(planned.stdout) == json.loads(given.stdout)
    go_offline(monkeypatch := pytest.MonkeyPatch(), True)
    try:  # offline: huggingface_hub's cache has the config now
        assert RUN.invoke(app, ["plan", str(media), "--model", REPO, "--json"]).exit_code == 0
        missing = RUN.invoke(app, ["plan", str(media), "--model", "acme/absent", "--json"])
        assert missing.exit_code == 2 and "not in the cache" in missing.stderr, missing.output
    finally:
        monkeypatch.undo()


def test_revision_with_a_local_folder_is_a_usage_error(sharded, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    photo(64, 96).save(media / "p0.png")
    result = encode([media, "-o", tmp_path / "out", "--model", sharded, "--revision", "v1", *BASE])
    assert result.exit_code == 2 and "--revision is for a hub id" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_a_cut_connection_resumes_with_only_the_rest(serve, sharded):
    header_bytes, vision_bytes, original = headers_and_vision(sharded)
    with serve() as server:
        server.cut_after = 300_000  # the first long range dies after this many bytes
        hub_mod.fetch(REPO, log=lambda m: None)
        assert server.cut_after is None  # it was cut
        resumed = [r for _, path, r in server.requests if r and path.endswith(".safetensors")]
        assert server.weight_bytes() <= (vision_bytes + header_bytes) * 1.05, resumed
    assert_same(fetched_tensors(hub_mod.repo_folder(REPO) / COMMIT), original)


def test_a_run_that_gives_up_is_resumed_by_the_next(serve, sharded, monkeypatch):
    header_bytes, vision_bytes, original = headers_and_vision(sharded)
    monkeypatch.setattr(hub_ranges, "RETRIES", 0)
    with serve() as server:
        server.cut_after = 300_000
        with pytest.raises(UsageError, match="run again to resume"):
            hub_mod.fetch(REPO, log=lambda m: None)
        folder = hub_mod.repo_folder(REPO) / COMMIT
        assert (folder / "model.safetensors.part").is_file() and not (folder / "model.safetensors").exists()
        first = server.weight_bytes()
        lines = []
        hub_mod.fetch(REPO, log=lines.append)
        assert any(line.startswith("resuming an earlier fetch: ") for line in lines), lines
        assert first < server.weight_bytes() <= (vision_bytes + 2 * header_bytes) * 1.05  # headers read twice
    assert not (folder / "model.safetensors.part").exists()
    assert_same(fetched_tensors(folder), original)


def test_a_new_commit_is_fetched_again(serve, sharded2):
    with serve() as server:
        hub_mod.fetch(REPO, log=lambda m: None)
        server.add(REPO, sharded2, COMMIT2)  # main moves on
        server.reset()
        report = hub_mod.fetch(REPO, log=lambda m: None)
        assert report["commit"] == COMMIT2 and not report["cached"] and server.weight_bytes() > 0
        assert find_checkpoint(REPO).revision == COMMIT2
    assert_same(fetched_tensors(Path(report["folder"])), headers_and_vision(sharded2)[2])
    assert (hub_mod.repo_folder(REPO) / COMMIT / "model.safetensors").is_file()  # the old one is kept


def test_a_server_without_range_support_still_works(serve, sharded):
    lines = []
    with serve(ranges=False):
        report = hub_mod.fetch(REPO, log=lines.append)
    assert report["range_requests"] is False
    assert sum("ignores Range requests" in line for line in lines) == 1, lines
    assert_same(fetched_tensors(Path(report["folder"])), headers_and_vision(sharded)[2])


def test_offline_uses_the_cache_and_says_so_when_it_is_empty(serve, monkeypatch):
    with serve() as server:
        hub_mod.fetch(REPO, revision="main", log=lambda m: None)
        go_offline(monkeypatch, True)
        server.reset()
        ckpt = find_checkpoint(REPO)
        assert ckpt.revision == COMMIT and server.requests == []
        empty = RUN.invoke(app, ["fetch", "acme/other"])
    assert empty.exit_code == 2
    lines = empty.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme/other: not in the Hugging Face cache and HF_HUB_OFFLINE is set" in lines[0]
    assert "run this fetch where the hub can be reached (HF_HUB_OFFLINE unset), then copy its cache" in lines[0]
    assert "gemma4enc fetch" not in lines[0]  # not told to run the command it is running


@pytest.mark.parametrize("gated, message", [(False, "RepositoryNotFoundError"), (True, "GatedRepoError")])
def test_hub_errors_are_one_line_and_exit_2(serve, gated, message):
    with serve() as server:
        repo = REPO if gated else "acme/missing"
        if gated:
            server.gated.add(REPO)
        result = RUN.invoke(app, ["fetch", repo, "--json"])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert json.loads(result.stdout)["exit_code"] == 2


def test_fetch_prints_what_it_fetched_and_where(serve):
    with serve():
        result = RUN.invoke(app, ["fetch", REPO, "--revision", COMMIT])
    assert result.exit_code == 0, result.output
    assert f"{REPO}@{COMMIT}:" in result.stdout and "bytes fetched" in result.stdout
    assert "skipped (no vision tensor): model-0000" in result.stdout
    assert f"folder: {hub_mod.repo_folder(REPO) / COMMIT}" in result.stdout
    assert RUN.invoke(app, ["fetch", "./here"]).exit_code == 2


def test_a_header_whose_sizes_do_not_add_up_is_refused(serve, sharded, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((sharded / "config.json").read_bytes())
    header = json.dumps({"model.vision_tower.x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with serve() as server:
        server.add("acme/bad", bad, COMMIT2)
        result = RUN.invoke(app, ["fetch", "acme/bad"])
    assert result.exit_code == 2 and "model.vision_tower.x: 8 bytes for F32 [4]" in result.stderr, result.output
    assert not (hub_mod.repo_folder("acme/bad") / COMMIT2 / "fetch.json").exists()


def test_hf_endpoint_in_the_environment_is_what_a_fresh_process_uses(serve, tmp_path):
    import os
    import subprocess
    import sys

    with serve() as server:
        env = os.environ | {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0"}
        env.pop("GEMMA4ENC_CACHE")  # the default: beside huggingface_hub's cache
        result = subprocess.run([sys.executable, "-m", "gemma4enc", "fetch", REPO, "--json"], env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        assert server.weight_bytes() > 0
    report = json.loads(result.stdout)
    assert report["folder"] == str(tmp_path / "home" / "gemma4enc" / "vision" / "acme--tiny-gemma4" / COMMIT)
    assert f"fetching {report['tensors']} vision tensors" in result.stderr


def test_a_host_that_does_not_resolve_falls_back_to_the_vision_cache(serve, monkeypatch):
    from huggingface_hub import constants

    with serve():
        hub_mod.fetch(REPO, log=lambda m: None)
    monkeypatch.setattr(constants, "ENDPOINT", "http://nonexistent.invalid")
    ckpt = find_checkpoint(REPO)
    assert ckpt.revision == COMMIT and (ckpt.root / "model.safetensors").is_file()


def test_a_cache_copied_elsewhere_is_used_where_it_is_now(serve, monkeypatch, tmp_path):
    import shutil

    with serve() as server:
        hub_mod.fetch(REPO, log=lambda m: None)
        shutil.move(tmp_path / "cache", tmp_path / "moved")
        monkeypatch.setenv("GEMMA4ENC_CACHE", str(tmp_path / "moved"))
        server.reset()
        online = hub_mod.fetch(REPO, log=lambda m: None)
        assert online["cached"] and server.weight_bytes() == 0
    go_offline(monkeypatch, True)
    want = tmp_path / "moved" / "acme--tiny-gemma4" / COMMIT
    assert Path(online["folder"]) == want and find_checkpoint(REPO).root == want


def test_a_hub_without_the_model_api_is_resolved_from_the_files(serve, sharded):
    header_bytes, vision_bytes, original = headers_and_vision(sharded)
    with serve(api=False) as server:
        report = hub_mod.fetch(REPO, log=lambda m: None)
        assert report["commit"] == COMMIT and server.weight_bytes() <= (vision_bytes + header_bytes) * 1.05
        missing = RUN.invoke(app, ["fetch", "acme/missing"])
    assert_same(fetched_tensors(Path(report["folder"])), original)
    assert missing.exit_code == 2 and "RepositoryNotFoundError" in missing.stderr, missing.output


def test_search_never_fetches_the_model_a_handed_over_outs_settings_name(serve, sharded, tmp_path):
    """A handed-over OUT whose settings.json names a hub model: `search OUT NEWFILE` fetched it at
    the OUT's word (any size, anyone's). It takes the caches only, refusing in one line that says
    why; once the user fetches the model, the same search answers."""
    media = tmp_path / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", sharded, *BASE]).exit_code == 0
    settings = json.loads((out / "settings.json").read_text())
    (out / "settings.json").write_text(json.dumps(settings | {"model": REPO}))
    photo(70, 70, seed=7).save(tmp_path / "new.png")
    with serve() as server:
        r = RUN.invoke(app, ["search", str(out), str(tmp_path / "new.png"), "-q"])
        assert r.exit_code == 2 and "does not fetch a model that an OUT's settings.json names" in r.output, r.output
        assert not [q for q in server.requests if REPO in q[1]], server.requests  # not even asked
        fetched = RUN.invoke(app, ["fetch", REPO, "--json"])  # the user's own choice
        assert fetched.exit_code == 0, fetched.output
        r = RUN.invoke(app, ["search", str(out), str(tmp_path / "new.png"), "--json"])
        assert r.exit_code == 0, r.output
        assert len(json.loads(r.stdout)["results"][0]["hits"]) == 2
