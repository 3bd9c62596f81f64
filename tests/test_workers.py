"""The decode pool: input order, bounded look-ahead, and a hung or crashing decoder costs one file."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gemma4enc.media.kinds import Item
from gemma4enc.media.prepare import Decoded
from gemma4enc.media.workers import DecodePool
from gemma4enc.options import Options


def fake_decode(item: Item, options: Options) -> Decoded:
    """Stands in for decode + patchify (workers import it by name): misbehaves as its file is named."""
    name = os.path.basename(item.path)
    Path(item.path + ".started").touch()
    if name.startswith("hang"):
        time.sleep(3600)
    if name.startswith("crash"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if name.startswith("exit"):
        os._exit(3)
    if name.startswith("raise"):
        raise RuntimeError("boom")
    number = int(name.split("-")[1])
    time.sleep(0.01 * (number % 3))  # finish out of order
    return Decoded(item, width=number, height=os.getpid())


def items(folder: Path, names: list[str]) -> list[Item]:
    return [Item(str(folder / n), "image", 1, 0) for n in names]


def test_results_come_back_in_order(tmp_path):
    names = [f"ok-{i}" for i in range(40)]
    got = list(DecodePool(Options(), workers=2, timeout=30, fn=fake_decode).map(items(tmp_path, names)))
    assert [d.width for d in got] == list(range(40))
    assert len({d.height for d in got}) == 2  # both workers took files
    assert all(d.status == "ok" for d in got)


def test_a_hung_or_crashing_decoder_costs_one_file(tmp_path):
    names = ["ok-1", "hang-2", "ok-3", "crash-4", "ok-5", "exit-6", "raise-7", "ok-8"]
    pool = DecodePool(Options(), workers=2, timeout=1.0, fn=fake_decode)
    got = {os.path.basename(d.item.path): d for d in pool.map(items(tmp_path, names))}  # hang-2 sleeps an hour
    assert [got[n].status for n in names] == ["ok", "timeout", "ok", "decode_error", "ok", "decode_error",
                                             "decode_error", "ok"]
    assert "--decode-timeout" in got["hang-2"].error
    assert "SIGSEGV" in got["crash-4"].error and "exit code 3" in got["exit-6"].error
    assert "RuntimeError: boom" in got["raise-7"].error
    assert pool.replaced == 3  # hang, crash, exit: each worker replaced, the run went on


def threads_given(item: Item, options: Options) -> Decoded:
    from gemma4enc.media import video as decode

    return Decoded(item, width=decode.THREADS)


def test_the_last_file_gets_the_idle_workers_cores(tmp_path):
    alone = list(DecodePool(Options(), workers=3, timeout=30, fn=threads_given).map(items(tmp_path, ["ok-0"])))
    assert [d.width for d in alone] == [3]
    many = list(DecodePool(Options(), workers=3, timeout=30, fn=threads_given).map(
        items(tmp_path, [f"ok-{i}" for i in range(6)])))
    assert [d.width for d in many[:-1]] == [1] * 5 and 1 <= many[-1].width <= 3
    two = list(DecodePool(Options(), workers=4, timeout=30, fn=threads_given).map(items(tmp_path, ["ok-0", "ok-1"])))
    assert [d.width for d in two] == [2, 2]  # fewer files than workers: the idle cores shared, none lent twice


def prepare_noting_threads(item: Item, options: Options) -> Decoded:
    from gemma4enc.media import video as decode
    from gemma4enc.media.prepare import prepare

    decoded = prepare(item, options)
    decoded.video["decoder_threads"] = decode.THREADS
    return decoded


def test_a_tail_video_decoded_with_threads_gives_the_same_patches(tmp_path):
    """Two long-GOP videos left for three workers: decoded with lent threads, the same patches as alone."""
    from gemma4enc.dev.demo import write_video
    from gemma4enc.options import Sampling

    write_video(tmp_path / "a.mp4", frames=300, gop=250)
    write_video(tmp_path / "b.mp4", frames=300, gop=250, codec="libx265")
    files = [Item(str(tmp_path / n), "video", (tmp_path / n).stat().st_size, 0) for n in ("a.mp4", "b.mp4")]
    options = Options(sampling=Sampling(frames=8))
    pooled = list(DecodePool(options, workers=4, timeout=120, fn=prepare_noting_threads).map(files))
    alone = list(DecodePool(options, workers=0, fn=prepare_noting_threads).map(files))
    assert [d.video["decoder_threads"] for d in pooled] == [2, 2] and alone[0].video["decoder_threads"] == 1
    for got, want in zip(pooled, alone):
        assert got.status == want.status == "ok" and got.video["frame_indices"] == want.video["frame_indices"]
        assert len(got.patches) == len(want.patches) == 8
        for p, q in zip(got.patches, want.patches):
            assert (p.pixels == q.pixels).all() and (p.positions == q.positions).all()


def test_look_ahead_is_bounded(tmp_path):
    names = [f"ok-{i}" for i in range(50)]
    results = DecodePool(Options(), workers=2, timeout=30, ahead=4, fn=fake_decode).map(items(tmp_path, names))
    first = next(results)
    time.sleep(1.0)  # a slow consumer (the tower): workers must not run ahead of it without bound
    started = len(list(tmp_path.glob("*.started")))
    assert first.width == 0 and started <= 1 + 4
    rest = list(results)
    assert len(rest) == 49


def test_workers_end_with_the_run(tmp_path):
    results = DecodePool(Options(), workers=2, timeout=30, fn=fake_decode).map(items(tmp_path, ["ok-0", "ok-1"]))
    pids = {next(results).height}
    results.close()  # what an interrupted run does
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
