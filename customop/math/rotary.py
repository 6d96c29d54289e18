"""The rotary-embedding math as pure functions (the readable spec), plus the shared input checks.

Notation: a cos/sin cache row holds ``cat(cos(p * inv_freq), sin(p * inv_freq))`` for one
position ``p`` (``rotary_dim`` lanes: cos in the first half, sin in the second). A head vector
``x`` of ``head_size`` lanes rotates its first ``rotary_dim`` lanes in pairs ``(x1, x2)``:

    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin

NeoX style pairs lane ``i`` with lane ``i + rotary_dim/2`` (the two halves); GPT-J style pairs
the even and odd lanes ``(2i, 2i+1)``. Lanes past ``rotary_dim`` pass through unchanged.
Arithmetic happens in the input's dtype (the cache is cast to it first), as vLLM's native path
and CUDA kernel do.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def rotate(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool) -> Tensor:
    """Rotates the lane pairs of ``x``'s last dim; ``cos``/``sin`` broadcast against one half."""
    if is_neox_style:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotate_heads(x: Tensor, cos: Tensor, sin: Tensor, head_size: int, is_neox_style: bool) -> Tensor:
    """``x`` views as ``[T, heads, head_size]`` with ``cos``/``sin`` ``[T, rotary_dim/2]``; the
    first ``rotary_dim`` lanes of every head rotate. Returns a new tensor of ``x``'s shape."""
    shape, tokens = x.shape, cos.shape[0]
    # ``-1`` cannot be inferred from an empty batch, so the head count is spelled out
    x = x.reshape(tokens, x.numel() // (tokens * head_size) if tokens else 0, head_size)
    rotary_dim = 2 * cos.shape[-1]
    x_rot = rotate(x[..., :rotary_dim], cos.unsqueeze(-2), sin.unsqueeze(-2), is_neox_style)
    return torch.cat((x_rot, x[..., rotary_dim:]), dim=-1).reshape(shape)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                     cos_sin_cache: Tensor, is_neox_style: bool) -> tuple[Tensor, Tensor | None]:
    """RoPE at ``positions`` (any shape, flattened to ``[T]``) on ``query``/``key`` (``[T, ...]``,
    viewable as ``[T, -1, head_size]``), with ``cos_sin_cache`` ``[max_pos, rotary_dim]``.
    Returns new tensors of the input shapes; ``key`` may be None."""
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).to(query.dtype).chunk(2, dim=-1)
    query = rotate_heads(query, cos, sin, head_size, is_neox_style)
    if key is not None:
        key = rotate_heads(key, cos, sin, head_size, is_neox_style)
    return query, key


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool = True,
                     enable_fp32_compute: bool = False) -> Tensor:
    """``x`` ``[B?, S, H, D]``, ``cos``/``sin`` ``[S, R/2]`` (already gathered per position):
    rotates the first ``R <= D`` lanes of every head, in fp32 when ``enable_fp32_compute`` and in
    ``x``'s dtype otherwise. Returns a new tensor of ``x``'s shape and dtype."""
    dtype = x.dtype
    if enable_fp32_compute:
        x = x.float()
    rotary_dim = 2 * cos.shape[-1]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    out = rotate(x[..., :rotary_dim], cos, sin, is_neox_style)
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out.to(dtype)


# ---- cache construction (fp32, as vLLM and HF do: models were trained with these roundings) ---


def rope_inv_freq(base: float, rotary_dim: int) -> Tensor:
    """``inv_freq[i] = base^(-2i / rotary_dim)`` for ``i < rotary_dim/2``, in fp32."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def cos_sin_cache(positions: Tensor, inv_freq: Tensor, mscale: float = 1.0) -> Tensor:
    """``cat(cos, sin)`` of ``outer(positions, inv_freq)``, each scaled by ``mscale``: the cache
    layout ``[len(positions), rotary_dim]``."""
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)


def cache_length(max_position: int, scaling_factor: float = 1.0) -> int:
    """How many rows a scaled cache holds: ``ceil(max_position * factor)`` (what
    ``torch.arange(max_position * factor)`` yields in vLLM)."""
    return math.ceil(max_position * scaling_factor)


# ---- input checks (every path) --------------------------------------------------------------------


def check_rotary_dims(op: str, head_size: int, rotary_dim: int) -> None:
    if head_size <= 0:
        raise ValueError(f"{op}: head_size must be positive, got {head_size}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"{op}: rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")


def check_rotary_inputs(op: str, positions: Tensor, query: Tensor, key: Tensor | None,
                        head_size: int, cos_sin_cache: Tensor) -> None:
    """What a kernel relies on: integer positions whose shape leads query's and key's, heads of
    ``head_size`` lanes, an even ``rotary_dim <= head_size``, one device and one float dtype.
    Every call of every path runs this (written for it: ~2-4 us on the CPU at decode sizes)."""
    pdtype = positions.dtype
    if pdtype.is_floating_point or pdtype.is_complex or pdtype == torch.bool:
        raise TypeError(f"{op}: positions must be an integer tensor, got {pdtype}")
    check_rotary_dims(op, head_size, cos_sin_cache.shape[-1])
    leading = positions.shape
    pdim = len(leading)
    pcpu = positions.is_cpu
    for name, x in (("query", query), ("key", key)):
        if x is None:
            continue
        if not x.dtype.is_floating_point:
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {x.dtype}")
        shape = x.shape
        if len(shape) <= pdim or shape[:pdim] != leading:
            raise ValueError(f"{op}: {name} of shape {tuple(shape)} must start with positions' "
                             f"shape {tuple(leading)} (one position per token)")
        if shape[-1] % head_size:
            raise ValueError(f"{op}: {name}'s last dim {shape[-1]} is not a multiple of head_size={head_size}")
        # both on the CPU: one device, without building two device objects
        if not (pcpu and x.is_cpu) and x.device != positions.device:
            raise ValueError(f"{op}: {name} is on {x.device} but positions is on {positions.device}")
    if key is not None and key.dtype != query.dtype:
        raise TypeError(f"{op}: key dtype {key.dtype} differs from query dtype {query.dtype}")
    check_positions_in_range(op, positions, cos_sin_cache.shape[0])


def check_positions_in_range(op: str, positions: Tensor, cache_rows: int) -> None:
    """Positions index the cache, so each must be in ``[0, cache_rows)``. Checked on CPU tensors
    outside compiled code, where reading them costs no device sync and breaks no graph; a device
    kernel does not check them (that would cost a host sync per call). Up to 16 positions are
    read as Python ints (~0.6 us at one token), more through ``aminmax`` and ``item`` (~2-4 us;
    comparing its 0-dim results as tensors cost ~6 us more)."""
    if not positions.is_cpu or torch.compiler.is_compiling():
        return
    count = positions.numel()
    if not count:
        return
    if count <= 16 and positions.dim() == 1:
        values = positions.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (v.item() for v in torch.aminmax(positions))
    if low < 0 or high >= cache_rows:
        raise IndexError(f"{op}: positions must be in [0, {cache_rows}) (the cos/sin cache's rows), "
                         f"got values from {int(low)} to {int(high)}")
