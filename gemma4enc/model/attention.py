"""Attention kept inside each item of a pack: items of any size laid end to end in one sequence,
each attending to itself only. On CUDA a varlen kernel over `cu_seqlens` (flash-attn if
installed, else PyTorch's own `varlen_attn`); elsewhere, or where that kernel fails, one SDPA
call per item. vision.Attention calls it when the encoder is given `segments`.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

from ..errors import one_line


def packed_attention(q, k, v, segments, cu, max_len, gqa: bool) -> torch.Tensor:
    """q, k, v: (heads, N, hd) of items laid end to end → (N, heads, hd), each item attending to
    itself only: a CUDA varlen kernel where there is one, else one SDPA call per item."""
    device = str(q.device)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and device not in _VARLEN_BROKEN:
        try:
            return _flash_varlen(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, max_len, 1.0
            )
        except (RuntimeError, ImportError, NotImplementedError, TypeError) as e:
            _VARLEN_BROKEN.add(device)  # e.g. an old GPU without flash kernels, an old torch
            warnings.warn(
                f"varlen attention failed on {device} ({one_line(e)}); packs use one SDPA call per item"
            )
    return _segment_sdpa(q, k, v, segments, 1.0, gqa)


_VARLEN_BROKEN: set[str] = set()  # devices where the varlen kernel failed once: use the loop


def _segment_sdpa(q, k, v, segments, scale, gqa):
    """Attention per item, one SDPA call each. q, k, v: (heads, N, head_dim) → (N, heads, head_dim)."""
    out = torch.empty(
        (q.shape[1], q.shape[0], q.shape[2]), dtype=q.dtype, device=q.device
    )  # (N, heads, hd)
    for start, end in segments:
        piece = F.scaled_dot_product_attention(
            q[:, start:end].unsqueeze(0),
            k[:, start:end].unsqueeze(0),
            v[:, start:end].unsqueeze(0),
            scale=scale,
            enable_gqa=gqa,
        )  # (1, heads, n, hd)
        out[start:end] = piece[0].transpose(0, 1)
    return out


def _flash_varlen(q, k, v, cu, max_len, scale):
    """A CUDA varlen kernel: flash-attn if installed, else PyTorch's own. (N, heads, head_dim) in and out."""
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale)
    except ImportError:
        from torch.nn.attention.varlen import varlen_attn

        return call_varlen(varlen_attn, q, k, v, cu, max_len, scale)


def call_varlen(varlen_attn, q, k, v, cu, max_len, scale):
    """PyTorch's varlen_attn across its releases: `scale=` and `enable_gqa=` came in later
    ones. Without `scale`, q is pre-multiplied so that the kernel's 1/sqrt(d) gives `scale`;
    without `enable_gqa`, the key/value heads are repeated as transformers' repeat_kv does."""
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
