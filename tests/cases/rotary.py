"""Float64 references of the rotary table (``customop/samples/rotary.py``), written independently
of ``customop.math``: the rotation as complex multiplication.

``check_rope_outputs`` judges a RotaryEmbedding path against the op's own cache rounded to the
query's dtype (the spec casts the cache first); ``rope_reference`` and ``assert_rotated`` serve
the other rotary tests (exact angles, scaling variants, ApplyRotaryEmb).
"""

from __future__ import annotations

import torch

from customop.testing import tolerance

EPS32 = torch.finfo(torch.float32).eps


def rope_reference(x, cos, sin, head_size, is_neox):
    """``x`` [T, ...] as heads of ``head_size``; pair (a, b) -> (a + ib) * (cos + i sin).
    Returns (rotated x in float64, |a| + |b| of each lane's pair in the same layout)."""
    shape, x = x.shape, x.double().reshape(cos.shape[0], -1, head_size)
    half = cos.shape[-1]
    rot = x[..., : 2 * half]
    a, b = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
    z = torch.complex(a, b) * torch.complex(cos.double(), sin.double())[:, None, :]
    mag = a.abs() + b.abs()
    if is_neox:
        out, mag = torch.cat((z.real, z.imag), -1), torch.cat((mag, mag), -1)
    else:
        out, mag = torch.stack((z.real, z.imag), -1).flatten(-2), mag.repeat_interleave(2, -1)
    passthrough = x[..., 2 * half:]
    out = torch.cat((out, passthrough), -1).reshape(shape)
    return out, torch.cat((mag, torch.zeros_like(passthrough)), -1).reshape(shape)


def assert_rotated(got, want, mag, dtype, extra=0.0, what="output", products_rounded=True):
    """The dtype's tolerance, plus ``extra`` relative error of cos/sin (for references built from
    exact angles) and, where the path rounds each product to the dtype (``products_rounded``: the
    eager spec rounds ``a*cos`` and ``b*sin``, at most eps/2 * (|a| + |b|) together), one eps of
    the pair's magnitude. A kernel rotates in fp32 and rounds once: ``products_rounded=False``."""
    atol, rtol = tolerance(dtype)
    err = (got.double() - want).abs()
    bound = atol + rtol * want.abs() + ((torch.finfo(dtype).eps if products_rounded else 0.0) + extra) * mag
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} lanes off; worst err "
                           f"{float(err.max()):.3g} at {tuple(int(i) for i in torch.nonzero(bad)[0])}")


def inv_freq64(base, d):
    return torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)


def check_rope_outputs(op, positions, q, k, out_q, out_k, products_rounded=True):
    """``op``'s outputs for ``(positions, q, k)`` (the inputs as they were before the call) against
    the rotation by the op's cache rows, rounded to the query's dtype as the spec casts them."""
    cache = op.cos_sin_cache.to(q.dtype).double()
    cos, sin = cache[positions.flatten().long()].chunk(2, dim=-1)
    for name, x, got in (("query", q, out_q), ("key", k, out_k)):
        if x is None:
            assert got is None
            continue
        want, mag = rope_reference(x.reshape(cos.shape[0], -1), cos, sin, op.head_size, op.is_neox_style)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert_rotated(got.reshape(cos.shape[0], -1), want, mag, x.dtype, what=name, products_rounded=products_rounded)


def check_apply_output(got, x, cos, sin, is_neox, fp32_compute, products_rounded=True):
    """ApplyRotaryEmb's output for ``(x, cos, sin)``: position ``s`` of every sequence rotates by
    row ``s``; the op casts cos/sin to the compute dtype first, the reference starts from those."""
    dtype, shape = x.dtype, x.shape
    assert got.dtype == dtype and got.shape == shape
    c, s = (cos, sin) if fp32_compute else (cos.to(dtype), sin.to(dtype))
    rows = shape[-3] if len(shape) == 3 else shape[0] * shape[1]
    repeat = rows // shape[-3]
    want, mag = rope_reference(x.reshape(rows, -1), c.repeat(repeat, 1), s.repeat(repeat, 1), shape[-1], is_neox)
    assert_rotated(got.reshape(rows, -1), want, mag, dtype, products_rounded=products_rounded)
