"""export: each format read back by its own consumer library equals what gemma4enc.open returns,
row for row, within the chosen dtype's rounding; failed and superseded rows never leak in."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest

import gemma4enc
from gemma4enc.commands.cli import app
from gemma4enc.errors import UsageError
from gemma4enc.output import export as export_module
from gemma4enc.output import formats
from gemma4enc.output.npreader import Shard
from gemma4enc.output.opening import open_out

from .helpers import RUN, folder_with_history


@pytest.fixture(scope="module")
def folder(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    media, out = folder_with_history(root, ckpt)
    return root, media, out


def export(out, dest, *extra, code=0):
    result = RUN.invoke(app, ["export", str(out), str(dest), *map(str, extra)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def reference(out):
    """path → (pooled float32, tokens float32, row) from the reader, for every file it gives."""
    emb = gemma4enc.open(out)
    return {p: (emb.pooled(p).float().numpy(), emb[p].float().numpy(), emb.row(p)) for p in emb}


def test_the_folder_has_history(folder):
    _, media, out = folder
    emb = gemma4enc.open(out)
    assert len(list(out.glob("shard-*.safetensors"))) == 7  # 5 + 1 of the first run, 1 of the second
    assert str(media / "p3.png") not in emb and emb.row(str(media / "p3.png"))["status"] != "ok"
    assert str(media / "broken.png") not in emb and len(emb) == 5
    assert gemma4enc.open(out).ledger.superseded == 2


def test_clip_layout_through_embedding_reader(folder):
    from embedding_reader import EmbeddingReader

    root, media, out = folder
    dest = root / "clip"
    report = json.loads(export(out, dest, "--to", "clip", "--rows-per-file", 2, "--json").stdout)
    assert report["rows"] == 5 and report["dtype"] == "float16" and report["normalized"]
    assert sorted(report["files"]) == sorted([f"img_emb/img_emb_{n}.npy" for n in range(3)]
                                             + [f"metadata/metadata_{n}.parquet" for n in range(3)])
    ref = reference(out)
    columns = ["path", "rel", "kind", "frames", "tokens", "width", "height", "sha256"]
    reader = EmbeddingReader(str(dest / "img_emb"), file_format="parquet_npy", metadata_folder=str(dest / "metadata"),
                             meta_columns=columns)
    assert reader.count == 5 and reader.dimension == 48
    seen = []
    for vectors, meta in reader(batch_size=2, show_progress=False):
        for vector, (_, m) in zip(vectors, meta.iterrows()):
            pooled, tokens, row = ref[m["path"]]
            want = pooled / np.linalg.norm(pooled)
            assert np.array_equal(vector, want.astype(np.float16).astype(np.float32)), m["path"]
            assert (m["kind"], m["tokens"], m["frames"], m["width"], m["height"], m["sha256"], m["rel"]) == (
                row["kind"], len(tokens), row["frames"], row["width"], row["height"], row["sha256"], row["rel"])
            seen.append(m["path"])
    assert sorted(seen) == sorted(ref)  # each latest ok row once: not broken.png, not p3's old row
    for n in range(3):  # the files themselves: float16, row-aligned, the run's settings in the Parquet metadata
        import pyarrow.parquet as pq

        array = np.load(dest / f"img_emb/img_emb_{n}.npy")
        meta = pq.read_table(dest / f"metadata/metadata_{n}.parquet")
        assert array.dtype == np.float16 and len(array) == meta.num_rows
        info = json.loads(meta.schema.metadata[b"gemma4enc"])
        assert info["settings"]["out_dtype"] == "bfloat16" and info["dtype"] == "float16" and info["normalized"]
    import faiss  # what autofaiss builds on: the exported vectors as they are, each its own nearest (or its copy's)

    vectors = np.concatenate([np.load(dest / f"img_emb/img_emb_{n}.npy") for n in range(3)]).astype(np.float32)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    scores, ids = index.search(vectors, 1)
    assert np.allclose(scores[:, 0], 1, atol=2e-3) and all(np.array_equal(vectors[i], vectors[j])
                                                           for i, j in enumerate(ids[:, 0]))
    changed = ref[str(media / "p1.png")][2]
    assert changed["width"] == 330  # the new row's, not the superseded one's


def test_clip_per_frame_in_float32_is_exact(folder):
    import pyarrow.parquet as pq

    root, media, out = folder
    dest = root / "frames"
    export(out, dest, "--per-frame", "--dtype", "float32", "--no-normalize")
    vectors = np.concatenate([np.load(p) for p in sorted(glob.glob(str(dest / "img_emb/*.npy")))])
    meta = pq.read_table(sorted(glob.glob(str(dest / "metadata/*.parquet")))).to_pylist()
    emb = gemma4enc.open(out)
    clip = str(media / "clip.mp4")
    assert [m["frame"] for m in meta if m["path"] == clip] == [0, 1, 2] and len(meta) == 4 + 3
    assert vectors.dtype == np.float32
    for vector, m in zip(vectors, meta):
        if m["path"] == clip:
            frame = emb.frames(clip)[m["frame"]]
            assert np.allclose(vector, frame.float().mean(0).numpy(), rtol=1e-6, atol=1e-7)
            row = emb.row(clip)
            assert (m["frame_index"], m["timestamp"], m["tokens"]) == (
                row["frame_indices"][m["frame"]], row["timestamps"][m["frame"]], len(frame))
        else:  # an image is frame 0, its stored vector: bfloat16 widened to float32 exactly
            assert np.array_equal(vector, emb.pooled(m["path"]).float().numpy()) and m["frame"] == 0
            assert m["frame_index"] is None


def test_parquet_through_datasets_pyarrow_and_duckdb(folder):
    import datasets
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, _, out = folder
    dest = root / "parquet"
    export(out, dest, "--to", "parquet", "--rows-per-file", 3)
    files = sorted(glob.glob(str(dest / "data/*.parquet")))
    assert len(files) == 2
    ref = reference(out)
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(root / "hf-cache"))
    assert ds.features["soft_tokens"] == datasets.Array2D(shape=(None, 48), dtype="float16")
    assert ds.features["pooled"] == datasets.List(datasets.Value("float16"), length=48)
    assert sorted(ds["path"]) == sorted(ref)
    for folder in (dest, dest / "data"):  # the folder as it is, or as parquet data: export.json is no data file
        whole = datasets.load_dataset(str(folder), split="train", cache_dir=str(root / "hf-cache"))
        assert sorted(whole["path"]) == sorted(ref) and whole.features == ds.features
    as_parquet = datasets.load_dataset("parquet", data_dir=str(dest), split="train", cache_dir=str(root / "hf-cache"))
    assert as_parquet.num_rows == 5
    for item in ds.with_format("numpy"):
        pooled, tokens, row = ref[item["path"]]
        assert np.array_equal(item["soft_tokens"], tokens.astype(np.float16)), item["path"]
        assert np.array_equal(item["pooled"], pooled.astype(np.float16))
        assert item["tokens"] == row["tokens"] and item["sha256"] == row["sha256"]
    table = pq.read_table(files)
    kind = table.schema.field("soft_tokens").type  # datasets, once imported, names the Array2D extension type
    storage = getattr(kind, "storage_type", kind)
    assert pa.types.is_list(storage) and pa.types.is_list(storage.value_type)
    assert storage.value_type.value_type == pa.float16()
    tokens = table.column("soft_tokens").combine_chunks()
    tokens = getattr(tokens, "storage", tokens)
    for path, n in zip(table.column("path").to_pylist(), range(table.num_rows)):
        want = ref[path][1].astype(np.float16)
        assert np.array_equal(np.array(tokens[n].values.flatten().to_numpy()).reshape(want.shape), want)
    assert json.loads(pq.read_schema(files[0]).metadata[b"gemma4enc"])["dtype"] == "float16"
    pattern = str(dest / "data/*.parquet")
    rows = duckdb.sql(f"select path, len(soft_tokens), len(pooled), soft_tokens[1][1] from '{pattern}'").fetchall()
    assert sorted(r[0] for r in rows) == sorted(ref)
    for path, n, d, first in rows:
        assert (n, d) == (len(ref[path][1]), 48)
        assert first == float(ref[path][1][0, 0].astype(np.float16))


def test_webdataset_tars_iterate_decoded(folder):
    import webdataset as wds

    root, _, out = folder
    dest = root / "wds"
    export(out, dest, "--to", "webdataset", "--rows-per-file", 2, "--dtype", "float32")
    tars = sorted(glob.glob(str(dest / "*.tar")))
    assert len(tars) == 3
    ref = reference(out)
    seen = []
    for sample in wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode():
        pooled, tokens, row = ref[sample["json"]["path"]]
        assert "." not in sample["__key__"] and sample["json"]["key"] == sample["__key__"]
        assert sample["npy"].dtype == np.float32 and np.array_equal(sample["npy"], tokens)  # bfloat16 → float32: exact
        assert np.array_equal(sample["pooled.npy"], pooled)
        seen.append(sample["json"]["path"])
    assert sorted(seen) == sorted(ref)


def test_clip_reads_no_tokens(folder, monkeypatch, tmp_path):
    _, _, out = folder
    reads = []
    real = Shard.rows
    monkeypatch.setattr(Shard, "rows", lambda self, name, lo, hi: reads.append(name) or real(self, name, lo, hi))
    export_module.export(open_out(out), "clip", tmp_path / "x")
    assert "tokens" not in reads and reads.count("pooled") == 5  # one window per shard still in use


def test_refusals_and_overwrite(folder, tmp_path):
    _, _, out = folder
    dest = tmp_path / "x"
    export(out, dest, "--dtype", "bfloat16", code=2)
    unknown = export(out, dest, "--to", "orc", code=2)
    assert "clip, parquet, webdataset, lance, vllm" in unknown.output  # every format named
    export(tmp_path / "nothing", dest, code=2)
    export(out, dest)
    result = export(out, dest, code=2)
    assert "not empty" in result.output
    (dest / "notes.txt").write_text("mine")
    export(out, dest, "--to", "webdataset", "--overwrite")
    left = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert left == ["000000.tar", "export.json", "notes.txt"]  # the clip files went, the user's file stayed


def test_float16_overflow_is_refused():
    with pytest.raises(UsageError, match="--dtype float32"):
        formats.cast(np.array([1e5], np.float32), "float16")
    assert formats.cast(np.array([1e5], np.float32), "float32")[0] == 1e5


def test_store_pooled_keeps_the_vectors_without_the_tokens(folder, ckpt):
    """encode --store pooled: the same pooled vectors bit for bit, per-frame means, no tokens; the reader
    says so, verify, compact --prune, export --to clip and search work on it."""
    import shutil

    import torch

    from gemma4enc.run.search import search

    from .helpers import encode, flags, verify

    root, media, out = folder
    copy = root / "media-pooled"
    shutil.copytree(media, copy)
    small = root / "pooled"
    args = [copy, "-o", small, "--model", ckpt, *flags(out_dtype="bfloat16", frames=3, json=False),
            "--workers", "0", "--max-soft-tokens", "70", "--hash", "--store", "pooled"]
    refused = encode([*args, "--no-pooled"])
    assert refused.exit_code == 2 and "--no-pooled" in refused.output and not small.exists()
    assert encode(args).exit_code == 1  # the broken files
    assert json.loads((small / "settings.json").read_text())["store"] == "pooled"
    big, little = gemma4enc.open(out), gemma4enc.open(small)
    assert sorted(p.replace(str(copy), str(media)) for p in little) == sorted(big)
    size = lambda folder: sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))  # noqa: E731
    assert size(small) * 20 < size(out)
    for path in little:
        assert torch.equal(little.pooled(path), big.pooled(path.replace(str(copy), str(media)))), path
    clip = str(copy / "clip.mp4")
    for reader in (little, gemma4enc.open(small, framework="numpy")):
        with pytest.raises(KeyError, match="--store pooled"):
            reader[clip]
        with pytest.raises(KeyError, match="--store pooled"):
            reader.frames(clip)
    keys, frames = little.pooled_matrix(per_frame=True)
    flat = gemma4enc.open(small, framework="numpy")
    for per_frame in (False, True):  # the numpy reader gives what torch's does, from the vectors alone
        (k_torch, m_torch), (k_numpy, m_numpy) = little.pooled_matrix(per_frame), flat.pooled_matrix(per_frame)
        assert k_torch == k_numpy and m_numpy.shape == m_torch.shape and np.array_equal(m_numpy, m_torch)
    want = {(p.replace(str(media), str(copy)), f): v for (p, f), v in zip(*big.pooled_matrix(per_frame=True))}
    for key, vector in zip(keys, frames):  # stored in bfloat16, computed from bfloat16 tokens in float32
        assert np.allclose(vector, want[key], rtol=1e-2, atol=1e-2), key
    assert verify(small)["ok"]

    dest = root / "pooled-clip"
    export(small, dest, "--per-frame", "--dtype", "float32", "--no-normalize")
    import pyarrow.parquet as pq

    vectors = np.concatenate([np.load(p) for p in sorted(glob.glob(str(dest / "img_emb/*.npy")))])
    meta = pq.read_table(sorted(glob.glob(str(dest / "metadata/*.parquet")))).to_pylist()
    stored = {key: vector for key, vector in zip(keys, frames)}
    assert len(meta) == len(keys)
    for vector, m in zip(vectors, meta):  # the stored frame means, as the reader gives them
        assert np.array_equal(vector, stored[(m["path"], m["frame"])]), m
    assert "--store pooled" in export(small, root / "pooled-parquet", "--to", "parquet", code=2).output
    hits = search(small, [str(copy / "p2.png")], k=1)["results"][0]["hits"]
    assert hits[0]["path"] == str(copy / "p2.png")

    before = {p: little.pooled(p) for p in little}
    (copy / "p2.png").unlink()
    result = RUN.invoke(app, ["compact", str(small), "--prune", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["pruned"] == 1, result.output
    assert verify(small)["ok"]
    after = gemma4enc.open(small)
    assert len(after) == len(before) - 1 and all(torch.equal(after.pooled(p), before[p]) for p in after)
    assert len(after.pooled_matrix(per_frame=True)[0]) == len(keys) - 1


def test_every_format_carries_the_sidecars_img2dataset_wrote(ckpt, tmp_path):
    """img2dataset → embeddings → clip-retrieval / datasets / WebDataset: a tar member's caption and
    url (its KEY.txt and KEY.json) come out of every export, read back by each format's library; a
    file without sidecars has none."""
    import io
    import tarfile

    import datasets
    import pyarrow.parquet as pq
    import webdataset as wds
    from embedding_reader import EmbeddingReader

    from .helpers import BASE, encode, photo

    media = tmp_path / "media"
    media.mkdir()
    for i in range(3):
        photo(48 + 8 * i, 64, seed=i).save(media / f"{i}.jpg")
    described = {"000000": {"url": "https://example.com/a.jpg", "caption": "a red fox", "key": "000000",
                            "status": "success", "width": 64},
                 "000001": {"url": "https://example.com/b.jpg", "caption": "from the json only"}}
    tar = tmp_path / "shard-00000.tar"
    with tarfile.open(tar, "w") as t:
        for key, src, txt in (("000000", media / "0.jpg", "a red fox, in the snow"), ("000001", media / "1.jpg", None)):
            t.add(src, arcname=f"{key}.jpg")
            for ext, data in ((".json", json.dumps(described[key])), (".txt", txt)):
                if data is not None:
                    info = tarfile.TarInfo(f"{key}{ext}")
                    info.size = len(data.encode())
                    t.addfile(info, io.BytesIO(data.encode()))
    out = tmp_path / "out"
    assert encode([tar, media / "2.jpg", "-o", out, "--model", ckpt, *BASE, "--workers", "0"]).exit_code == 0
    want = {f"{tar}/000000.jpg": ("a red fox, in the snow", "https://example.com/a.jpg"),
            f"{tar}/000001.jpg": ("from the json only", "https://example.com/b.jpg"),
            str(media / "2.jpg"): (None, None)}
    sidecar = {p: r.get("sidecar") for p, r in gemma4enc.open(out).ok_rows()}
    assert sidecar[f"{tar}/000000.jpg"] == {"json": described["000000"], "txt": "a red fox, in the snow"}

    def check(path, caption, url, whole):
        assert (caption, url) == want[path], path
        assert (json.loads(whole) if isinstance(whole, str) else whole) == sidecar[path], path

    for extra in ((), ("--per-frame",)):  # clip-retrieval's layout, through embedding-reader
        dest = tmp_path / ("clip" + "".join(extra))
        export(out, dest, "--to", "clip", *extra)
        reader = EmbeddingReader(str(dest / "img_emb"), file_format="parquet_npy",
                                 metadata_folder=str(dest / "metadata"), meta_columns=["path", "caption", "url", "sidecar"])
        seen = [m for _, meta in reader(batch_size=10, show_progress=False) for _, m in meta.iterrows()]
        assert sorted(m["path"] for m in seen) == sorted(want)
        for m in seen:
            check(m["path"], m["caption"], m["url"], m["sidecar"])
    dest = tmp_path / "parquet"  # datasets
    export(out, dest, "--to", "parquet")
    ds = datasets.load_dataset(str(dest), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.features["caption"] == datasets.Value("string") and ds.num_rows == 3
    for item in ds:
        check(item["path"], item["caption"], item["url"], item["sidecar"])
    assert pq.read_table(dest / "data").column("caption").null_count == 1
    dest = tmp_path / "wds"  # WebDataset: the caption as KEY.txt, as img2dataset wrote it
    export(out, dest, "--to", "webdataset")
    samples = list(wds.WebDataset(sorted(glob.glob(str(dest / "*.tar"))), shardshuffle=False,
                                  empty_check=False).decode())
    assert len(samples) == 3
    for sample in samples:
        meta = sample["json"]
        check(meta["path"], meta["caption"], meta["url"], meta["sidecar"])
        assert sample.get("txt") == want[meta["path"]][0]  # absent where there is no caption


def test_lance_through_pylance_and_lancedb(ckpt, tmp_path):
    """--to lance, read back by pylance and LanceDB: one row per latest ok file (photos, a clip, a
    captioned WebDataset member), tokens and vectors equal to gemma4enc.open's in the export dtype,
    the settings in the schema's metadata; a vector search in LanceDB finds a near copy; a second
    export appends only what OUT gained (a new Lance version) and deletes what OUT no longer holds."""
    import io
    import tarfile

    import lance
    import lancedb

    from gemma4enc.dev.demo import write_video

    from .helpers import BASE, encode, photo

    media = tmp_path / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80), (48, 120)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    (media / "copy.png").write_bytes((media / "p0.png").read_bytes())
    write_video(media / "clip.mp4", frames=8)
    tar = tmp_path / "shard-00000.tar"
    with tarfile.open(tar, "w") as t:
        t.add(media / "p1.png", arcname="000000.png")
        data = b"a red fox"
        info = tarfile.TarInfo("000000.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    args = [media, tar, "-o", out, "--model", ckpt, *BASE, "--workers", "0"]
    assert encode(args).exit_code == 0
    dest = tmp_path / "table.lance"
    report = json.loads(export(out, dest, "--to", "lance", "--dtype", "float32", "--json").stdout)
    assert report["rows"] == 6 and report["added"] == 6 and report["deleted"] == 0
    ref = reference(out)
    table = lance.dataset(str(dest)).to_table()
    assert sorted(table.column("path").to_pylist()) == sorted(ref)
    for r in table.to_pylist():
        pooled, tokens, row = ref[r["path"]]
        assert np.array_equal(np.array(r["soft_tokens"], np.float32), tokens), r["path"]  # float32: exact
        assert np.array_equal(np.array(r["vector"], np.float32), pooled), r["path"]
        assert (r["kind"], r["size"], r["mtime_ns"], r["frames"]) == (
            row["kind"], row["size"], row["mtime_ns"], row["frames"])
    caption = {r["path"]: r["caption"] for r in table.to_pylist()}
    assert caption[f"{tar}/000000.png"] == "a red fox" and caption[str(media / "p0.png")] is None
    settings = json.loads(lance.dataset(str(dest)).schema.metadata[b"gemma4enc"])
    assert settings["format"] == "lance" and settings["settings"]["model"] and settings["dtype"] == "float32"

    found = lancedb.connect(str(tmp_path)).open_table("table")
    assert found.count_rows() == 6
    copy, original = str(media / "copy.png"), str(media / "p0.png")
    near = found.search(ref[copy][0], vector_column_name="vector").metric("cosine").limit(2).to_list()
    assert {n["path"] for n in near} == {copy, original}  # the byte copy and its original, first

    again = json.loads(export(out, dest, "--to", "lance", "--dtype", "float32", "--json").stdout)
    assert again["added"] == 0 and again["deleted"] == 0 and again["rows"] == 6
    photo(100, 140, seed=33).save(media / "new.png")  # OUT gains a file
    (media / "p2.png").unlink()  # and one is pruned from it
    assert encode(args).exit_code == 0
    assert RUN.invoke(app, ["compact", str(out), "--prune"]).exit_code == 0
    third = json.loads(export(out, dest, "--to", "lance", "--dtype", "float32", "--json").stdout)
    assert third["added"] == 1 and third["deleted"] == 1 and third["version"] > again["version"], third
    paths = lance.dataset(str(dest)).to_table(columns=["path"]).column("path").to_pylist()
    assert sorted(paths) == sorted(gemma4enc.open(out)) and len(paths) == 6
    refused = export(out, dest, "--to", "lance", "--dtype", "float16", code=2)
    assert "other settings (dtype" in refused.output
    over = json.loads(export(out, dest, "--to", "lance", "--overwrite", "--json").stdout)
    assert over["rows"] == 6 and over["dtype"] == "float16"


@pytest.mark.slow
def test_lance_into_s3_is_read_back_by_pylance_and_lancedb(ckpt, tmp_path, monkeypatch):
    """--to lance with an s3:// DEST (moto's S3 on loopback, found through the AWS_* variables as
    every store access is): the table holds what the local export holds, LanceDB opens it in the
    bucket, a second export appends nothing; an endpoint that answers nothing ends in one line,
    in bounded time (an http:// endpoint Lance was not told to allow hung the export)."""
    import time

    import lance
    import lancedb

    from gemma4enc.output.tolance import storage_options

    from .helpers import BASE, encode, loopback_s3, photo

    media = tmp_path / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(64, 96), (80, 80)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *BASE, "--workers", "0"]).exit_code == 0
    export(out, tmp_path / "local.lance", "--to", "lance", "--dtype", "float32")
    local = lance.dataset(str(tmp_path / "local.lance")).to_table().sort_by("path")
    with loopback_s3("bucket") as (fs, _):
        report = json.loads(export(out, "s3://bucket/emb/table.lance", "--to", "lance", "--dtype", "float32",
                                   "--json").stdout)
        assert report["rows"] == 2 and report["added"] == 2
        store = storage_options("s3://bucket/emb/table.lance")
        remote = lance.dataset("s3://bucket/emb/table.lance", storage_options=store).to_table().sort_by("path")
        assert remote.column("path").to_pylist() == local.column("path").to_pylist()
        assert remote.column("vector").to_pylist() == local.column("vector").to_pylist()
        assert remote.column("soft_tokens").to_pylist() == local.column("soft_tokens").to_pylist()
        found = lancedb.connect("s3://bucket/emb", storage_options=store).open_table("table")
        assert found.count_rows() == 2
        again = json.loads(export(out, "s3://bucket/emb/table.lance", "--to", "lance", "--dtype", "float32",
                                  "--json").stdout)
        assert again["added"] == 0 and again["rows"] == 2
        assert all("testing" not in str(v) for v in report.values())  # no key in what it says
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    start = time.monotonic()
    r = RUN.invoke(app, ["export", str(out), "s3://bucket/none.lance", "--to", "lance"])
    assert r.exit_code in (2, 4) and "Traceback" not in r.output and time.monotonic() - start < 240, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
