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


# ---- the cos/sin cache of every rope type, from vLLM 0.33's formulas, in float64 ------------------

import math  # noqa: E402


def table64(t, inv_freq, mscale=1.0):
    """``cat(cos, sin) * mscale`` of ``t ⊗ inv_freq`` and the angles (for the fp32 error bound)."""
    angles = torch.as_tensor(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), -1) * mscale, torch.cat((angles, angles), -1)


def get_mscale64(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1


def yarn_inv_freq64(base, d, factor, original, beta_fast=32, beta_slow=1, truncate=True):
    def turns_at(rotations):  # the pair index whose wavelength fits `rotations` times in `original`
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_at(beta_fast), turns_at(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    plain = inv_freq64(base, d)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low if high != low else 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return plain / factor * (1 - keep) + plain * keep


def yarn_magnitude64(p):
    """vLLM 0.33's YaRN magnitude: attention_factor, else the mscale ratio when both are set, else
    get_mscale(factor)."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return get_mscale64(p["factor"], p["mscale"]) / get_mscale64(p["factor"], p["mscale_all_dim"])
    return get_mscale64(p["factor"])


def llama3_inv_freq64(base, d, factor, low_ff, high_ff, original):
    out = []
    for f in inv_freq64(base, d).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < original / high_ff:
            out.append(f)
        elif wavelen > original / low_ff:
            out.append(f / factor)
        else:
            a = (original / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - a) * f / factor + a * f)
    return torch.tensor(out, dtype=torch.float64)


def rope_cache64(head_size, max_position, p, positions_factor=4):
    """The float64 cache get_rope(head_size, max_position, rope_parameters=p) must hold, written
    from vLLM 0.33's formulas: ``(table [rows, width], angles of the same shape)``."""
    base, kind = p.get("rope_theta", 10000), p.get("rope_type", "default")
    d = p.get("rope_dim") or int(head_size * p.get("partial_rotary_factor", 1.0))
    L = max_position
    if kind == "default" and "mrope_section" in p:
        return table64(torch.arange(positions_factor * L), inv_freq64(base, d))
    if kind in ("default", "bailing_mrope", "openpangu"):
        rows = L if kind == "default" else 4 * L
        return table64(torch.arange(rows), inv_freq64(base, d))
    if kind == "linear":
        factors = p["factor"] if isinstance(p["factor"], (list, tuple)) else [p["factor"]]
        t = torch.cat([torch.arange(math.ceil(L * f), dtype=torch.float64) / f for f in factors])
        return table64(t, inv_freq64(base, d))
    if kind == "dynamic" and "alpha" in p:
        return table64(torch.arange(L), inv_freq64(base * p["alpha"] ** (d / (d - 2)), d))
    if kind == "dynamic":
        k, trained = p["factor"], p.get("max_trained_positions", L)
        return table64(torch.arange(L), inv_freq64(base * (k * L / trained - (k - 1)) ** (d / (d - 2)), d))
    if kind == "ntk":
        k, b = p["factor"], p.get("mixed_b")
        i = torch.arange(d // 2, dtype=torch.float64)
        if b is None:
            inv = (base * k) ** (-2 * i / d) / k ** (2 / d)
        else:
            inv = base ** (-2 * i / d) / torch.exp(math.log(k) / (d / 2) ** b * (i + 1) ** b)
        return table64(torch.arange(L), inv)
    if kind == "llama3":
        return table64(torch.arange(L), llama3_inv_freq64(base, d, p["factor"], p["low_freq_factor"],
                                                          p["high_freq_factor"], p["original_max_position_embeddings"]))
    if kind == "yarn":
        k, O = p["factor"], p["original_max_position_embeddings"]
        M = O * positions_factor if "mrope_section" in p else O
        inv = yarn_inv_freq64(base, d, k, M, p.get("beta_fast", 32), p.get("beta_slow", 1), p.get("truncate", True))
        return table64(torch.arange(math.ceil(M * k)), inv, yarn_magnitude64(p))
    if kind in ("deepseek_yarn", "deepseek_llama_scaling"):
        k, O = p["factor"], p["original_max_position_embeddings"]
        inv = yarn_inv_freq64(base, d, k, O, p.get("beta_fast", 32), p.get("beta_slow", 1))
        m = get_mscale64(k, p.get("mscale", 1)) / get_mscale64(k, p.get("mscale_all_dim", 0))
        return table64(torch.arange(math.ceil(O * k)), inv, m)
    if kind == "longrope":
        O = p["original_max_position_embeddings"]
        f = 1.0 if L <= O else math.sqrt(1 + math.log(L / O) / math.log(O))
        short = table64(torch.arange(O), inv_freq64(base, d) / torch.tensor(p["short_factor"], dtype=torch.float64),
                        p.get("short_mscale", f))
        long = table64(torch.arange(L), inv_freq64(base, d) / torch.tensor(p["long_factor"], dtype=torch.float64),
                       p.get("long_mscale", f))
        return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))
    if kind == "proportional":
        i = torch.arange(head_size // 2, dtype=torch.float64)
        inv = torch.where(i < d // 2, base ** (-2 * i / head_size), torch.zeros_like(i))
        return table64(torch.arange(L), inv)
    raise AssertionError(f"no float64 formula for rope type {kind!r}")


def assert_cache_matches(cache, want, angles, what=""):
    """A cache built in fp32 (as vLLM does) and stored in ``cache.dtype``: the fp32 angle is off by
    a few ulps of itself, cos/sin by that plus their own rounding, then the dtype's rounding."""
    assert cache.shape == want.shape, f"{what}: cache shape {tuple(cache.shape)}, want {tuple(want.shape)}"
    scale = max(float(want.abs().max()), 1.0)
    bound = scale * (8 * EPS32 * angles.abs() + 4 * EPS32) + torch.finfo(cache.dtype).eps * want.abs()
    err = (cache.double() - want).abs()
    worst = tuple(torch.nonzero(err > bound)[:1].flatten().tolist())
    assert (err <= bound).all(), f"{what}: max err {float(err.max()):.3g}, worst excess at {worst}"
