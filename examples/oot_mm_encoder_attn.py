"""An out-of-tree replacement of ``MMEncoderAttention``, as a hardware vendor's plugin would ship it.

    python examples/oot_mm_encoder_attn.py

The vendor's device has no varlen attention kernel, only a batched one that takes a key-padding
mask. So its ``forward_oot`` pads every segment of the packed sequence to the longest one, runs
one masked attention call over that batch, and gathers the rows back. Its platform ("npu" here;
the CPU plays the device) names ``forward_oot`` as the method enabled ops run, which is how
customop dispatches to out-of-tree code. Registering the class with
``@CustomOp.register_oot("MMEncoderAttention")`` makes every ``MMEncoderAttention(...)``
construction build it instead, and ``customop.testing.assert_conforms`` runs it on the op's
registered samples (every head layout and dtype of ``customop/samples/attention.py``) against the
in-tree ``forward_native``. A vendor runs the same check on its own device with ``device="npu"``.

Exit status 0 when the replacement conforms.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from customop import Config, CustomOp, use_config
from customop.math.attention import segment_lengths
from customop.ops.attention import MMEncoderAttention
from customop.platforms import Platform, PlatformEnum
from customop.testing import assert_conforms, forced_platform


class NpuPlatform(Platform):
    """The vendor's platform: enabled ops run ``forward_oot``."""

    _enum = PlatformEnum.OOT
    name = "npu"
    device_type = "cpu"  # the stand-in device of this example
    forward_method = "forward_oot"


@CustomOp.register_oot("MMEncoderAttention")
class PaddedMMEncoderAttention(MMEncoderAttention):
    """Encoder attention as one padded, masked batch: ``[N, L_max, H, D]`` for N segments."""

    def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        if cu_seqlens is None or query.shape[0] != 1:
            # one segment per row (or several rows): plain batched attention is the spec's own path
            return self.forward_native(query, key, value, cu_seqlens, max_seqlen)
        self.check_inputs(query, key, value, cu_seqlens)  # the in-tree op's argument checks and messages
        tokens = query.shape[1]
        lengths = torch.tensor(segment_lengths(cu_seqlens, tokens))  # checked: starts at 0, ends at tokens
        if tokens == 0:
            return query.new_empty(query.shape)
        count, longest = len(lengths), int(lengths.max())
        # token t of segment s goes to row s, column t - start(s) of the padded batch
        segment = torch.repeat_interleave(torch.arange(count), lengths)
        column = torch.arange(tokens) - (torch.cumsum(lengths, 0) - lengths)[segment]
        slot = (segment * longest + column).to(query.device)
        keep = torch.zeros(count * longest, dtype=torch.bool, device=query.device)
        keep[slot] = True

        def padded(t, heads):
            t = t.reshape(tokens, heads, self.head_size)
            out = t.new_zeros(count * longest, heads, self.head_size)
            out[slot] = t
            return out.view(count, longest, heads, self.head_size).transpose(1, 2)  # [N, H, L, D]

        q, k, v = padded(query, self.num_heads), padded(key, self.num_kv_heads), padded(value, self.num_kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.view(count, 1, 1, longest), scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        rows = out.transpose(1, 2).reshape(count * longest, self.num_heads, self.head_size)[slot]
        return rows.reshape(query.shape)


def main() -> int:
    npu = NpuPlatform()
    with forced_platform(npu), use_config(Config(custom_ops=["all"])):
        attn = MMEncoderAttention(num_heads=16, head_size=80)
    print(f"MMEncoderAttention(...) built {type(attn).__name__}, running {attn.forward_method_name}")
    assert isinstance(attn, PaddedMMEncoderAttention) and attn.forward_method_name == "forward_oot"

    # Two images of 64 and 100 patches and eight 16-patch windows, packed into one sequence.
    lengths = [64, 100] + [16] * 8
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(1, sum(lengths), 16 * 80) for _ in range(3))
    out = attn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=torch.tensor(max(lengths)))
    err = (out - attn.forward_native(q, k, v, cu_seqlens)).abs().max().item()
    print(f"packed call: output {tuple(out.shape)}, max difference from the spec {err:.2e}")

    assert_conforms(PaddedMMEncoderAttention, platform=npu)  # raises, listing every failure
    print("PaddedMMEncoderAttention conforms to mm_encoder_attn on every sample and dtype")
    return 0


if __name__ == "__main__":
    sys.exit(main())
