"""OutBackend's contract (output/backend.py): the dozen operations on which a folder, a store and
memory differ, each held to the same promises on all three (as zarr's one store test suite runs on
memory, local and fsspec). OUT's own rules above them are tests/test_out.py's.

Each test gets a fresh backend opened to write, and `listed()`, what OUT itself holds by name (not
the backend's working copy): a promise kept only in the copy is not kept."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from gemma4enc.errors import UsageError
from gemma4enc.output.backend import FolderBackend, OutBackend
from gemma4enc.output.ledger import Ledger
from gemma4enc.output.memorybackend import MemoryBackend
from gemma4enc.output.names import MANIFEST, PARTS, SETTINGS



def _append(backend: OutBackend, data: bytes) -> None:
    with open(backend.local / MANIFEST, "ab") as f:  # as files.append_rows does, fsync aside
        f.write(data)


class BackendContract:
    backend: OutBackend

    def reopen(self) -> OutBackend:
        """A second backend on the same OUT, as the next command opens it."""
        raise NotImplementedError

    def listed(self) -> set[str]:
        return set(self.reopen().listing())

    def test_write_then_list_fetch_and_delete(self):
        self.backend.write("shard-000000.safetensors", b"abc")
        other = self.reopen()
        assert other.listing()["shard-000000.safetensors"] == 3
        assert other.fetch("shard-000000.safetensors").read_bytes() == b"abc"
        self.backend.delete(["shard-000000.safetensors", "shard-000009.safetensors"])  # a missing one: no error
        assert "shard-000000.safetensors" not in self.listed()

    def test_put_makes_a_local_file_ours_and_drops_the_copy_unless_kept(self):
        shard = self.backend.local / "shard-000001.safetensors"
        shard.write_bytes(b"tokens")
        self.backend.put(shard)
        assert "shard-000001.safetensors" in self.listed()
        assert shard.exists() == self.backend.in_place  # a copy is dropped once it is OUT's
        cache = self.backend.local / "search-index.json"
        cache.write_bytes(b"{}")
        self.backend.put(cache, keep=True)
        assert cache.exists() and "search-index.json" in self.listed()

    def test_push_sends_whole_lines_once(self):
        _append(self.backend, b'{"a": 1}\n{"b": 2')  # the second line still being written
        self.backend.push()
        self.backend.push()  # nothing new: nothing sent twice
        held = self._manifest()
        assert held[: held.rfind(b"\n") + 1] == b'{"a": 1}\n'  # a folder's holds the half line too, as a torn tail
        _append(self.backend, b'}\n')
        self.backend.push("task")
        assert self._manifest() == b'{"a": 1}\n{"b": 2}\n'

    def test_replace_manifest_leaves_only_the_new_manifest(self):
        _append(self.backend, b'{"a": 1}\n{"a": 2}\n')
        self.backend.push()
        (self.backend.local / MANIFEST).write_bytes(b'{"a": 2}\n')  # as compaction rewrites it
        self.backend.replace_manifest()
        assert self._manifest() == b'{"a": 2}\n'
        _append(self.backend, b'{"c": 3}\n')
        self.backend.push()
        assert self._manifest() == b'{"a": 2}\n{"c": 3}\n'

    def test_the_lock_excludes_a_second_holder_and_names_the_first(self):
        with self.backend.lock():
            holder = self.reopen().holder()
            assert holder is not None and "pid" in holder
        assert self.reopen().holder() is None

    def test_a_shard_is_readable_only_where_ours_holds_it_whole(self):
        self.backend.write("shard-000002.safetensors", save({"x": np.zeros(2, np.float32)}))
        names = {"shard-000002.safetensors", "shard-000005.safetensors"}
        assert self.backend.readable(names) == {"shard-000002.safetensors"}

    def test_the_handle_is_where_a_task_puts_its_shards(self):
        place = self.backend.handle()
        with place.staging() as folder:
            shard = Path(folder) / "shard-00000000000000aa-000.safetensors"
            shard.write_bytes(b"a task's tokens")
            place.put(shard)
        assert "shard-00000000000000aa-000.safetensors" in self.listed()

    def _manifest(self) -> bytes:
        """The manifest as OUT holds it (a store's: base and parts, as the next open reads them)."""
        again = self.reopen()
        return (again.local / MANIFEST).read_bytes() if (again.local / MANIFEST).exists() else b""


class TestFolderBackend(BackendContract):
    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path):
        self.backend = FolderBackend(tmp_path / "out")
        self.backend.local.mkdir()

    def reopen(self) -> OutBackend:
        return FolderBackend(self.backend.local)

    def test_settle_cuts_a_torn_line_so_the_next_append_starts_its_own(self):
        # a kill mid-append tears OUT's own manifest only where appends go to OUT itself; a copy's
        # torn line dies with its process (the stores' torn parts: test_out.py's tear)
        _append(self.backend, b'{"a": 1}\n')
        self.backend.push()
        _append(self.backend, b'{"torn": ')
        self.backend.settle(Ledger(self.backend.local).refresh())
        _append(self.backend, b'{"b": 2}\n')
        self.backend.push()
        assert self._manifest() == b'{"a": 1}\n{"b": 2}\n'

    def test_a_link_is_listed_and_removed_never_followed(self, tmp_path):
        decoy = tmp_path / "decoy"
        decoy.write_bytes(b"the user's")
        (self.backend.local / "shard-000003.safetensors").symlink_to(decoy)
        assert "shard-000003.safetensors" in self.listed()
        self.backend.delete(["shard-000003.safetensors"])
        assert decoy.read_bytes() == b"the user's"

    def test_overwrite_never_reaches_through_a_planted_parts_link(self, tmp_path):
        """A handed-over OUT whose manifest.parts links to the user's folder: --overwrite's clear
        lists and deletes OUT's own files only; the decoys there stay byte-identical."""
        from gemma4enc.output.out import Out

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        decoy = elsewhere / "000000000001-run.jsonl"
        decoy.write_bytes(b"the user's")
        (self.backend.local / PARTS).symlink_to(elsewhere, target_is_directory=True)
        self.backend.write("shard-000000.safetensors", b"ours")
        assert self.backend.listing(PARTS) == {}
        Out(self.backend).clear()
        assert decoy.read_bytes() == b"the user's" and "shard-000000.safetensors" not in self.listed()
        self.backend.delete([f"{PARTS}/000000000001-run.jsonl"])
        assert decoy.read_bytes() == b"the user's"

    def test_the_handle_is_picklable(self):
        assert pickle.loads(pickle.dumps(self.backend.handle())) == self.backend.handle()


class TestMemoryBackend(BackendContract):
    @pytest.fixture(autouse=True)
    def _objects(self):
        self.objects: dict[str, bytes] = {}
        self.backend = MemoryBackend(self.objects).open()
        yield
        self.backend.close()

    def reopen(self) -> OutBackend:
        return MemoryBackend(self.objects).open()

    def test_two_threads_never_hold_it_at_once(self):
        held, refused = threading.Event(), []

        def second():
            held.wait(5)
            try:
                with self.reopen().lock():
                    pass  # pragma: no cover - refused while the first holds
            except UsageError:
                refused.append(True)

        thread = threading.Thread(target=second)
        thread.start()
        with self.backend.lock():
            held.set()
            thread.join(10)
        assert refused == [True]


@pytest.mark.slow
class TestStoreBackend(BackendContract):
    @pytest.fixture(autouse=True)
    def _store(self, contract_s3, request):
        from gemma4enc.output.storebackend import StoreBackend

        self.url = f"s3://{contract_s3[1]}/{request.node.name}"
        self.backend = StoreBackend(self.url).open(write=True)
        self.opened = [self.backend]
        yield
        for b in self.opened:
            b.close()

    def reopen(self) -> OutBackend:
        from gemma4enc.output.storebackend import StoreBackend

        again = StoreBackend(self.url).open()
        self.opened.append(again)
        return again

    def test_the_lock_excludes_a_second_holder_and_names_the_first(self):
        # a store's lock is taken when it is opened to write (out.py): held since the fixture
        from gemma4enc.output.storebackend import StoreBackend

        with self.backend.lock():
            holder = self.reopen().holder()
            assert holder is not None and "pid" in holder
            with pytest.raises(UsageError, match="in use by another gemma4enc run"):
                StoreBackend(self.url).open(write=True)

    def test_parts_are_counted_and_merged_by_replace_manifest(self):
        _append(self.backend, b'{"a": 1}\n')
        self.backend.push()
        _append(self.backend, b'{"a": 2}\n')
        self.backend.push()
        assert self.backend.parts == 2 and len(self.reopen().listing(PARTS)) == 2
        self.backend.replace_manifest()
        assert self.backend.parts == 0 and not self.reopen().listing(PARTS)
        assert SETTINGS not in self.listed() and MANIFEST in self.listed()
