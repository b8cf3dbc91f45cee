"""``rotary_embedding`` in pure torch, with vLLM's signature and in-place contract (see the
package docstring for why SGLang's test server needs it)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, is_neox: bool) -> None:
    """Rotate ``x`` (tokens, heads, rotary_dim) in place; cos/sin are (tokens, 1, rotary_dim/2)."""
    if is_neox:
        first, second = x.chunk(2, dim=-1)
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if is_neox:
        x.copy_(torch.cat((rotated_first, rotated_second), dim=-1))
    else:
        x.copy_(torch.stack((rotated_first, rotated_second), dim=-1).flatten(-2))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Apply rotary position embedding to ``query`` and ``key`` in place, as vLLM's kernel does:
    ``cos_sin_cache`` is (max_position, rotary_dim) with cos in the first half, sin in the
    second; only the first ``rotary_dim`` values of each head rotate."""
    positions = positions.flatten()
    tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    rotary_dim = cos_sin.shape[-1]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for tensor in (query, key):
        if tensor is None:
            continue
        heads = tensor.view(tokens, -1, head_size)
        rotary = heads[..., :rotary_dim]
        _rotate(rotary, cos.to(tensor.dtype), sin.to(tensor.dtype), is_neox=is_neox)
