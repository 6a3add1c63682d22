"""Rotary position embedding, neox style (HF's rotate_half), from a precomputed cos/sin cache.

cos_sin_cache is [max_position, rot_dim] = cat(cos, sin) over rot_dim // 2 frequencies, as in vLLM.
Unlike vLLM's in-place op this one returns new tensors, so the graph stays functional.
"""
import torch
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


def _rotate_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, rot_dim]; cos/sin: [T, 1, rot_dim] = cat(c, c) as HF builds them.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_gptj(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Interleaved pairs (x0, x1), (x2, x3), ...; cos/sin: [T, 1, rot_dim // 2].
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_ref(x: Tensor, positions: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """Rotate x [T, H * head_size] or [T, H, head_size] (one of query / key) by each token's position."""
    shape = x.shape
    x = x.view(shape[0], -1, head_size)
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    rot_dim = cos_sin_cache.shape[-1]
    if is_neox:
        rot = _rotate_neox(x[..., :rot_dim], torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    else:
        rot = _rotate_gptj(x[..., :rot_dim], cos, sin)
    if rot_dim < head_size:  # partial rotary: the tail of each head passes through
        rot = torch.cat((rot, x[..., rot_dim:]), dim=-1)
    return rot.reshape(shape)


@graphinfer_op()
def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Rotate query [T, Hq * head_size] (or [T, Hq, head_size]) and key likewise by each token's position."""
    return (rotary_ref(query, positions, head_size, cos_sin_cache, is_neox),
            rotary_ref(key, positions, head_size, cos_sin_cache, is_neox))


@register_fake(rotary_embedding)
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    return torch.empty_like(query), torch.empty_like(key)
