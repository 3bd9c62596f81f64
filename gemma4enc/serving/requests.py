"""vLLM prompt dicts for files an OUT holds: the keys as `multi_modal_uuids`, and stand-in media
only big enough to size the placeholders.

vLLM's Gemma 4 takes no embeddings in a request (it rejects `image_embeds`), so a request still
carries an image or a video, but vLLM reads from it only what sizes the prompt: an image's width
and height, a video's frame count, frame size and timestamps (frame index / fps). A flat image of
the file's decoded size, and flat frames with the row's frame indices and rate, give the same
prompt as the file's own pixels, and the connector (or an export read by vLLM's ECExampleConnector)
supplies the tokens. Their colour is cache.STAND_IN, which no real file is made of: a stand-in
whose key the connector cannot find fails its request loudly instead of being answered from
(vllm_connector.py). `{"image": None}` must never stand in: vLLM then drops the image silently.

Over HTTP (`vllm serve`'s OpenAI API), a request carries files, not arrays: `stand_in_file` gives the
bytes and MIME type of a PNG stand-in, or of a lossless clip of stand-in frames at a rate that keeps
the sampled frames' mm:ss timestamps, for a data URL whose part's `uuid` is the key.

Runs in vLLM's environment: numpy, Pillow and cache.py only (and OpenCV or PyAV to write a clip).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .cache import STAND_IN, OutCache

IMAGE, VIDEO = "<|image|>", "<|video|>"  # Gemma 4's placeholders, one per item, in the prompt's order


def stand_in(row: dict):
    """The cheapest media vLLM sizes the same placeholders from as the file's own pixels."""
    from PIL import Image

    width, height = int(row["width"]), int(row["height"])
    if row["kind"] == "image":
        return Image.new("RGB", (width, height), STAND_IN)
    frames = np.empty((len(row["frame_indices"]), height, width, 3), np.uint8)
    frames[...] = STAND_IN
    return frames, video_metadata(row)


def video_metadata(row: dict) -> dict:
    """What vLLM's Gemma 4 processor takes with a video's frames: their indices and the rate that
    turns them into the prompt's mm:ss timestamps; the frames are the ones gemma4enc sampled."""
    return {
        "fps": float(row.get("fps") or 24.0),
        "frames_indices": list(row["frame_indices"]),
        "total_num_frames": int(row.get("total_frames") or len(row["frame_indices"])),
        "duration": float(row.get("duration") or 0.0),
        "video_backend": "gemma4enc",
        "do_sample_frames": False,
    }


def request(index: OutCache | dict, paths: list[str], prompt: str) -> dict:
    """One vLLM prompt dict for `prompt` (with one <|image|> or <|video|> per path, in order).

    index: an OutCache, or the rows of an export's index.jsonl by path (`export_index(DIR)`).
    """
    rows = []
    for path in paths:
        if isinstance(index, OutCache):
            entry = index.by_path.get(path) or index.by_path.get(os.path.abspath(path))
            row = dict(entry.row, key=entry.key) if entry else None
        else:
            row = index.get(path) or index.get(os.path.abspath(path))
        if row is None:
            raise KeyError(f"{path}: no key for it in the OUT (not encoded, failed, or without a content hash)")
        rows.append(row)
    wanted = [IMAGE if r["kind"] == "image" else VIDEO for r in rows]
    found = [p for p in _placeholders(prompt)]
    if found != wanted:
        raise ValueError(f"the prompt's placeholders {found} do not match the files' kinds {wanted}")
    data: dict[str, list] = {}
    uuids: dict[str, list] = {}
    for r in rows:
        data.setdefault(r["kind"], []).append(stand_in(r))
        uuids.setdefault(r["kind"], []).append(r["key"])
    return {"prompt": prompt, "multi_modal_data": data, "multi_modal_uuids": uuids}


def _placeholders(prompt: str) -> list[str]:
    out, i = [], 0
    while True:
        hits = [(prompt.find(p, i), p) for p in (IMAGE, VIDEO)]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            return out
        at, p = min(hits)
        out.append(p)
        i = at + len(p)


def export_index(folder: str) -> dict:
    """An export's index.jsonl (`gemma4enc export OUT DIR --to vllm`) as {path: row with its key}."""
    rows = {}
    with open(os.path.join(folder, "index.jsonl")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row["path"]] = row
    return rows


def _mmss(seconds: float) -> str:
    """A frame's timestamp as Gemma 4's prompt writes it (int-truncated mm:ss, as transformers)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def stand_in_rate(row: dict) -> float:
    """The constant frame rate at which a file of len(frame_indices) frames shows the same mm:ss
    timestamps as the frames gemma4enc sampled (index / fps); ValueError where no rate does."""
    idx, fps = list(row["frame_indices"]), float(row.get("fps") or 24.0)
    rate = fps if len(idx) < 2 or idx[-1] == idx[0] else fps * (len(idx) - 1) / (idx[-1] - idx[0])
    if [_mmss(i / rate) for i in range(len(idx))] != [_mmss(i / fps) for i in idx]:
        raise ValueError(
            f"{row.get('path')}: its frames' timestamps ({', '.join(_mmss(i / fps) for i in idx)}) are not those "
            "of any file at a constant rate: serve it through the offline API (request()), which takes the frames"
        )
    return rate


def stand_in_file(row: dict) -> tuple[bytes, str]:
    """(bytes, MIME type) of what the OpenAI API can carry for a file OUT holds, as a data URL with
    the key as the part's uuid: an image, a PNG of its stand-in; a video, a lossless clip (FFV1 in
    Matroska) of len(frame_indices) stand-in frames at stand_in_rate, so vLLM (which samples every
    frame of a clip no longer than its num_frames) makes the prompt the key was encoded for.
    The server's video num_frames must be at least the clip's frames (gemma4enc's --frames)."""
    import io
    import tempfile

    if row["kind"] == "image":
        buf = io.BytesIO()
        stand_in(row).save(buf, "PNG")  # lossless: the stand-in stays STAND_IN exactly
        return buf.getvalue(), "image/png"
    rate = stand_in_rate(row)
    frames, _ = stand_in(row)
    with tempfile.TemporaryDirectory(prefix="gemma4enc-stand-in-") as tmp:
        path = os.path.join(tmp, "stand-in.mkv")
        _write_lossless(path, frames, rate)
        with open(path, "rb") as f:
            return f.read(), "video/x-matroska"


def _write_lossless(path: str, frames: np.ndarray, rate: float) -> None:
    """FFV1 frames through OpenCV (vLLM's environment has it) or PyAV (gemma4enc's has it)."""
    height, width = frames.shape[1:3]
    try:
        import cv2
    except ImportError:
        cv2 = None
    if cv2 is not None:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"FFV1"), rate, (width, height))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write an FFV1 clip here")
        for frame in frames:
            writer.write(frame[..., ::-1].copy())  # OpenCV takes BGR
        writer.release()
        return
    from fractions import Fraction

    import av

    with av.open(path, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=Fraction(rate).limit_denominator(1_000_000))
        stream.width, stream.height, stream.pix_fmt = width, height, "bgr0"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def sampled_file(path: str, row: dict) -> tuple[bytes, str]:
    """(bytes, MIME type) of a video's own frames at the indices gemma4enc sampled, as a lossless clip
    at stand_in_rate: sent without a key (or under one OUT lacks), vLLM answers from the same frames
    the key's tokens were made from, where the file itself would be sampled by vLLM's own rule
    (8 of 120 frames: [0, 17, …, 119] against gemma4enc's [0, 15, …, 105]). Needs PyAV; the frames
    are those of a plain full decode in presentation order, as gemma4enc's decoder is tested to give."""
    import tempfile

    import av

    wanted = {int(i): n for n, i in enumerate(row["frame_indices"])}
    rate = stand_in_rate(row)  # before decoding: refused at once where no rate keeps the timestamps
    frames: list = [None] * len(wanted)
    with av.open(path) as container:
        stream = container.streams.video[0]
        for at, frame in enumerate(container.decode(stream)):
            if at in wanted:
                frames[wanted[at]] = frame.to_ndarray(format="rgb24")
            if at >= max(wanted):
                break
    if any(f is None for f in frames):
        raise ValueError(f"{path}: the file has fewer frames than the row's indices: is it still the file encoded?")
    with tempfile.TemporaryDirectory(prefix="gemma4enc-frames-") as tmp:
        clip = os.path.join(tmp, "frames.mkv")
        _write_lossless(clip, np.stack(frames), rate)
        with open(clip, "rb") as f:
            return f.read(), "video/x-matroska"
