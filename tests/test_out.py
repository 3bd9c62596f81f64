"""OUT's contract, the same for every backend (in the manner of zarr's store tests): one class of
behaviours, run on memory (`TestMemoryOut`, the fast default), on a folder (`TestFolderOut`) and on
a loopback S3 (`TestStoreOut`, moto); the last two are marked slow.

Each behaviour opens OUT as the commands do (`open_out`; memory: an `Out` over the same dict),
writes through the `Out` it gets, and checks what a later open of the same OUT reads back: what one
backend does, the others must do too, and where they differ on purpose (when the lock is taken)
the test says so."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from gemma4enc.errors import UsageError
from gemma4enc.options import Options, Sampling
from gemma4enc.output.names import LOCK, MANIFEST, SETTINGS
from gemma4enc.output.opening import open_out
from gemma4enc.output.memorybackend import MemoryBackend
from gemma4enc.output.out import Out
from gemma4enc.output.reader import Embeddings
from gemma4enc.output.shards import ShardWriter
from gemma4enc.rows import Row, Status


OPTIONS = Options(dtype="float32", sampling=Sampling(frames=4))


MEDIA = "/nonexistent-media"  # the rows' files: none exists unless a test makes it (prune)


def path(i: int, media: str = MEDIA) -> str:
    return f"{media}/{i}.jpg"


def row(i: int, status: str = Status.OK, media: str = MEDIA) -> Row:
    return Row(path(i, media), "image", 100 + i, 7, status, tokens=3 if status == Status.OK else 0,
               frames=1 if status == Status.OK else 0)


def dead_pid() -> int:
    """A pid no process of this host has (a run that was killed)."""
    pid = 999_999
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


class OutContract:
    """What every backend of OUT must do. A subclass gives `where` (OUT as a user names it) and the
    store-side views: `names()` (what OUT holds, by name) and `plant(name, data)`."""

    where: str

    def open(self, write: bool = False, overwrite: bool = False) -> Out:
        return open_out(self.where, write=write, overwrite=overwrite)

    def names(self) -> set[str]:
        raise NotImplementedError

    def plant(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def remove(self, name: str) -> None:
        raise NotImplementedError

    def tear(self, data: bytes) -> None:
        """What a kill mid-append leaves at the manifest's end, as this backend can be left with it."""
        raise NotImplementedError

    def write(self, files: range, value: float = 0.0, per_shard: int = 100, media: str = MEDIA) -> None:
        """Files' tokens in shards (`per_shard` files each), their rows in the manifest, under the lock."""
        with self.open(write=True) as out, out.locked():
            out.prepare(OPTIONS)
            out.record_settings(OPTIONS)
            writer = ShardWriter(out, "float32", {"model": "test"}, shard_bytes=per_shard * 3 * 4 * 4)
            for i in files:
                writer.add(row(i, media=media), [torch.full((3, 4), value + i)])
            writer.close()

    def rows(self) -> dict[str, dict]:
        with self.open() as out:
            ledger = out.ledger()
            return {p: ledger.row(p) for p in ledger}

    # settings

    def test_settings_are_recorded_once_and_an_output_shaping_change_is_refused(self):
        self.write(range(1))
        with self.open() as out:
            recorded = out.settings()
        assert recorded["sampling"] == {"frames": 4, "fps": None, "max_frames": 32}
        with self.open(write=True) as out, out.locked():
            out.prepare(Options(dtype="float32", sampling=Sampling(frames=4), workers=3))  # speed only
            with pytest.raises(UsageError, match=r"other settings \(dtype: 'float32' → 'bfloat16'\)"):
                out.prepare(Options(dtype="bfloat16", sampling=Sampling(frames=4)))
            out.record_settings(Options(dtype="bfloat16"))  # recorded once: a later run only checks
        with self.open() as out:
            assert out.settings() == recorded

    # the lock

    def test_a_second_holder_is_refused_while_the_first_holds(self):
        self.write(range(1))
        with self.open(write=True) as first, first.locked():
            with pytest.raises(UsageError, match="in use by another gemma4enc run"):
                with self.open(write=True) as second, second.locked():
                    pass  # pragma: no cover - the lock must refuse before this
            with self.open() as reader:
                assert reader.holder() is not None and str(os.getpid()) in reader.holder()
        with self.open() as reader:
            assert reader.holder() is None  # released

    def test_a_dead_holders_lock_is_taken_over_and_said(self):
        self.write(range(1))
        gone = {"pid": dead_pid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00+0000"}
        self.plant(LOCK, json.dumps(gone).encode())
        with self.open() as reader:
            assert reader.holder() is None  # a killed run holds nothing
        with self.open(write=True) as out, out.locked() as lock:
            assert lock.previous["pid"] == gone["pid"]

    # appends and the ledger

    def test_rows_appended_are_what_the_next_open_reads(self):
        self.write(range(3))
        with self.open(write=True) as out, out.locked():
            out.append([row(1, Status.DECODE_ERROR).to_json()])
            out.append([row(7, Status.UNSUPPORTED).to_json()], later=True)
            out.sync()
        rows = self.rows()
        assert sorted(rows) == [path(0), path(1), path(2), path(7)]
        assert rows[path(1)]["status"] == Status.DECODE_ERROR  # the latest row wins
        assert rows[path(0)]["shard"] in self.names()

    def test_a_torn_last_line_is_dropped_by_repair(self):
        self.write(range(2))
        self.tear(b'{"path": "/nonexistent-media/torn.jpg", "sta')
        with self.open(write=True) as out, out.locked():
            out.prepare(OPTIONS)
            out.append([row(5, Status.DECODE_ERROR).to_json()])  # on a line of its own
        assert sorted(self.rows()) == [path(0), path(1), path(5)]

    # repair

    def test_repair_marks_a_lost_shards_rows_and_removes_orphans_and_nothing_else(self):
        self.write(range(4), per_shard=2)  # two shards
        with self.open() as out:
            lost = out.ledger().row(path(0))["shard"]
        self.remove(lost)
        self.plant("shard-000099.safetensors", b"an orphan: no row names it")
        self.plant("notes.txt", b"the user's own")
        with self.open(write=True) as out, out.locked():
            notes = out.prepare(OPTIONS)
        assert any("missing or unreadable" in n for n in notes), notes
        rows = self.rows()
        assert [rows[path(i)]["status"] for i in range(4)] == [
            Status.SHARD_LOST, Status.SHARD_LOST, Status.OK, Status.OK]
        assert "shard-000099.safetensors" not in self.names() and "notes.txt" in self.names()

    # compaction

    def test_compact_keeps_each_files_latest_row_and_prune_rewrites_the_shard(self, tmp_path):
        media = str(tmp_path / "media")
        os.makedirs(media)
        for i in (1, 2):  # 0 is gone: prune drops its row and its tokens
            open(path(i, media), "wb").close()
        self.write(range(3), per_shard=3, media=media)  # one shard of three
        with self.open(write=True) as out, out.locked():
            out.append([row(2, Status.DECODE_ERROR, media).to_json()])
            report = out.compact(out.ledger())
        assert (report["rows_before"], report["rows_after"]) == (4, 3)
        with self.open() as out:
            ledger = out.ledger()
            assert ledger.lines == 3 and ledger.row(path(2, media))["status"] == Status.DECODE_ERROR
            old = ledger.row(path(0, media))["shard"]
        with self.open(write=True) as out, out.locked():
            report = out.compact(out.ledger(), prune=True)
        assert (report["pruned"], report["shards_rewritten"]) == (1, 1)
        rows = self.rows()
        assert sorted(rows) == [path(1, media), path(2, media)]
        assert rows[path(1, media)]["shard"] != old and rows[path(1, media)]["index"] == 0
        assert old not in self.names() and rows[path(1, media)]["shard"] in self.names()
        with self.open() as out:
            assert torch.equal(Embeddings(out)[path(1, media)], torch.full((3, 4), 1.0))

    def test_the_compact_command_keeps_every_shard_a_row_names(self):
        """`compact` gives no ledger (Out.compact reads its own, repairs, then compacts): the
        shards its rows name stay, and only those no row names go."""
        self.write(range(4), per_shard=2)  # two shards
        self.plant("shard-000099.safetensors", b"an orphan: no row names it")
        with self.open(write=True) as out, out.locked():
            out.append([row(3, Status.DECODE_ERROR).to_json()])
            report = out.compact()
        assert (report["rows_before"], report["rows_after"]) == (5, 4)
        rows = self.rows()
        named = {r["shard"] for r in rows.values() if r["status"] == Status.OK}
        assert len(named) == 2 and named <= self.names() and "shard-000099.safetensors" not in self.names()
        with self.open() as out:
            assert torch.equal(Embeddings(out)[path(0)], torch.full((3, 4), 0.0))

    # shard numbering, fetching, removal

    def test_shards_are_numbered_on_from_the_highest(self):
        self.write(range(2), per_shard=1)
        with self.open() as out:
            assert out.next_shard() == 2 and sorted(out.shard_names()) == [
                "shard-000000.safetensors", "shard-000001.safetensors"]
        self.write(range(2, 3), per_shard=1)
        assert "shard-000002.safetensors" in self.names()

    def test_a_shard_read_once_leaves_no_fetched_copy(self):
        self.write(range(1))
        with self.open() as out:
            name = out.ledger().row(path(0))["shard"]
            with out.shard(name) as local:
                assert local.stat().st_size > 0
            assert out.path(name).exists() == out.in_place  # a folder's own shard is never touched
        assert name in self.names()

    def test_remove_shards_takes_a_tasks_shards_only(self):
        self.write(range(1))
        for name in ("shard-00000000000000aa-000.safetensors", "shard-00000000000000aa-001.safetensors",
                     "shard-00000000000000bb-000.safetensors"):
            self.plant(name, b"a task's shard")
        with self.open(write=True) as out, out.locked():
            out.remove_shards(("shard-00000000000000aa-",))
        left = self.names()
        assert "shard-00000000000000bb-000.safetensors" in left
        assert not [n for n in left if n.startswith("shard-00000000000000aa-")]
        assert "shard-000000.safetensors" in left

    def test_overwrite_clears_what_gemma4enc_wrote_and_nothing_else(self):
        self.write(range(2))
        self.plant("notes.txt", b"the user's own")
        with self.open(write=True, overwrite=True) as out, out.locked():
            out.prepare(OPTIONS, overwrite=True)
        left = self.names()
        assert "notes.txt" in left and not [n for n in left if n.startswith("shard-") or n == SETTINGS]
        with self.open() as out:
            assert not out.found() or len(out.ledger()) == 0


class TestMemoryOut(OutContract):
    """OUT as a dict: every rule of Out in milliseconds, with no disk to fill nor store to start."""

    @pytest.fixture(autouse=True)
    def _objects(self):
        self.objects: dict[str, bytes] = {}
        self.where = "memory://contract"

    def open(self, write: bool = False, overwrite: bool = False) -> Out:
        return Out(MemoryBackend(self.objects, self.where).open())

    def names(self) -> set[str]:
        return set(self.objects)

    def plant(self, name: str, data: bytes) -> None:
        self.objects[name] = data

    def remove(self, name: str) -> None:
        del self.objects[name]

    def tear(self, data: bytes) -> None:
        # pushed lines are whole; a manifest object that ends mid-line (written by another tool)
        self.objects[MANIFEST] += data


@pytest.mark.slow
class TestFolderOut(OutContract):
    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path):
        self.folder = tmp_path / "out"
        self.where = str(self.folder)

    def names(self) -> set[str]:
        return {p.name for p in self.folder.iterdir()}

    def plant(self, name: str, data: bytes) -> None:
        (self.folder / name).write_bytes(data)

    def remove(self, name: str) -> None:
        (self.folder / name).unlink()

    def tear(self, data: bytes) -> None:
        with open(self.folder / MANIFEST, "ab") as f:  # half a line, as a kill mid-append leaves it
            f.write(data)


@pytest.mark.slow
class TestStoreOut(OutContract):
    @pytest.fixture(autouse=True)
    def _prefix(self, contract_s3, request):
        self.s3, bucket = contract_s3
        self.prefix = f"{bucket}/{request.node.name}"
        self.where = f"s3://{self.prefix}"

    def names(self) -> set[str]:
        self.s3.invalidate_cache()
        return {p[len(self.prefix) + 1:] for p in self.s3.find(self.prefix)}

    def plant(self, name: str, data: bytes) -> None:
        self.s3.pipe_file(f"{self.prefix}/{name}", data)

    def remove(self, name: str) -> None:
        self.s3.rm_file(f"{self.prefix}/{name}")

    def tear(self, data: bytes) -> None:
        # a part is written whole or not at all; one that ends mid-line (written by hand, or by
        # another tool) is the store's nearest to a torn append
        self.plant("manifest.parts/000000000099-torn.jsonl", data)
