"""Float64 reference of ``CustomQwen2Decoder`` (``customop/samples/qwen2_decoder.py``): a Qwen2 stack
written from the formulas (RMSNorm, neox RoPE at positions 0..S-1 with theta, GQA attention with the
image/query mask built here by loops, SwiGLU), with no customop op or math. Values are rounded to the
input dtype where the layers store them (every projection, norm, rotation, attention output, product
and residual sum), so that the comparison measures the layers' arithmetic, not the dtype's.
"""

from __future__ import annotations

import torch


def ref_mask(seq: int, attention_mask: torch.Tensor | None, batch: int) -> torch.Tensor:
    """``[B, S, S]`` bool: image half (first S // 2) visible to all, query half causal on itself."""
    n = seq // 2
    allow = torch.zeros(seq, seq, dtype=torch.bool)
    for i in range(seq):
        for j in range(seq):
            allow[i, j] = j < n or (i >= n and n <= j <= i)
    allow = allow.expand(batch, seq, seq).clone()
    if attention_mask is not None:
        allow &= attention_mask.bool().cpu()[:, None, :]
    return allow


def ref_decoder(op, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    dtype = x.dtype
    rnd = (lambda t: t.to(dtype).double())  # noqa: E731
    p = {name: t.detach().double().cpu() for name, t in op.named_parameters()}
    cfg = op.model.layers[0].self_attn
    heads, kv_heads, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    eps = op.model.norm.eps
    b, s, _ = x.shape
    theta = op.rotary_emb.base
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [S, hd/2]
    cos, sin = rnd(angles.cos())[:, None, :], rnd(angles.sin())[:, None, :]
    allow = ref_mask(s, attention_mask, b)[:, None]  # [B, 1, S, S]

    def norm(h, w):
        return rnd(rnd(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)) * w)

    def lin(h, prefix, bias=False):
        out = h @ p[prefix + ".weight"].t()
        return rnd(out + p[prefix + ".bias"] if bias else out)

    def rope(t):  # [B, S, H, hd], neox halves
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat((rnd(t1 * cos - t2 * sin), rnd(t2 * cos + t1 * sin)), dim=-1)

    h = x.double().cpu()
    for i in range(len(op.model.layers)):
        pre = f"model.layers.{i}."
        a = norm(h, p[pre + "input_layernorm.weight"])
        q = rope(lin(a, pre + "self_attn.q_proj", True).reshape(b, s, heads, hd)).transpose(1, 2)
        k = rope(lin(a, pre + "self_attn.k_proj", True).reshape(b, s, kv_heads, hd)).transpose(1, 2)
        v = lin(a, pre + "self_attn.v_proj", True).reshape(b, s, kv_heads, hd).transpose(1, 2)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
        scores = scores.masked_fill(~allow, float("-inf"))
        attn = rnd(scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * hd)
        h = rnd(h + lin(attn, pre + "self_attn.o_proj"))
        m = norm(h, p[pre + "post_attention_layernorm.weight"])
        gate, up = lin(m, pre + "mlp.gate_proj"), lin(m, pre + "mlp.up_proj")
        act = rnd(rnd(gate * torch.sigmoid(gate)) * up)
        h = rnd(h + lin(act, pre + "mlp.down_proj"))
    return norm(h, p["model.norm.weight"])
