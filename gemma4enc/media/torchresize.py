"""--resize torchvision: the pixels of transformers' default Gemma 4 processors, the torchvision
backend (`Gemma4ImageProcessor`, `Gemma4VideoProcessor`), which vLLM uses, with torch alone.

Those processors call torchvision's `resize(..., BICUBIC, antialias=True)` on a contiguous
(C, H, W) uint8 tensor. On the CPU torchvision hands a uint8 tensor straight to torch's own
`interpolate(mode="bicubic", antialias=True, align_corners=False)` (its native uint8 path), so
calling that op the same way gives the same bytes without importing torchvision
(tests/test_torchvision_pixels.py holds them equal). PIL's bicubic, the other modes' resize,
rounds differently by up to a few 8-bit levels.

torch is imported at the first call, so decode workers of the other modes never load it.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _torch():
    import multiprocessing

    import torch

    if multiprocessing.parent_process() is not None:  # a decode worker: one of many, one core each
        torch.set_num_threads(1)
    return torch


def resize(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 → (height, width, 3) uint8, as torchvision's resize in those processors."""
    torch = _torch()
    if array.shape[:2] == (height, width):
        return array  # the processors skip the resize at the target size
    chw = torch.from_numpy(np.require(array, requirements="CW")).permute(2, 0, 1).contiguous()  # as they make it
    out = torch.nn.functional.interpolate(
        chw.unsqueeze(0), size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return np.ascontiguousarray(out[0].permute(1, 2, 0).numpy())
