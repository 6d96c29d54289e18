"""The MLA decode kernel (backends/triton/mla.py) under the Triton interpreter: the launcher and
the split kernels against a float64 reference of ``customop::mla_decode`` (the op's own reference
on float64 copies) on tiny shapes (L=32, R=16, 4 heads, blocks of 16), contexts 1, 15, 16, 17 and
70 in 1, 2, 3 and 5 splits with a padded, shuffled block table and an empty row, every dtype,
poisoned outputs; every tile path under ``kernel.override`` (several head blocks, heads not a
multiple of the block, tiles inside a cache block and across blocks, L and R not powers of two);
bad inputs; opcheck; then the layer end to end through ``forward_kernel`` with the
launcher as the CPU kernel of ``customop::mla_decode``, against the float64 layer reference
(``tests/cases/mla.py``), and decode == prefill through the kernel."""

from __future__ import annotations

import pytest
import torch

from customop.backends.triton import mla as kernel
from customop.math.mla import paged_latent_decode
from customop.testing import assert_close, randn
from tests.backends.triton import aot_subprocess
from tests.backends.triton.conftest import as_cpu_kernel

pytestmark = pytest.mark.interpret

L, R, HEADS, BLOCK = 32, 16, 4, 16
CONTEXTS = (1, 15, 16, 17, 70, 0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: bf16/fp16 by normwise relative error: the kernel rounds the probabilities to the input dtype
#: before P @ kv_c and the output once (the reference neither)
NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float32:
        assert_close(got, expected, dtype, what=what)
        return
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= NORMWISE[dtype], f"{what}: normwise relative error {err:.2e} > {NORMWISE[dtype]:.2e}"


def inputs(dtype: torch.dtype, contexts=CONTEXTS, seed: int = 0, heads: int = HEADS, block: int = BLOCK,
           lat: int = L, rope: int = R):
    """Rows with the given contexts; blocks shuffled over a cache with spare blocks, the table
    padded to the widest row with -1 (never read) and NaN in the unused cache rows (never read)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // block) for c in contexts) + 1
    used = sum(-(-c // block) for c in contexts)
    order = torch.randperm(used + 3, generator=gen)
    cache = torch.full((used + 3, block, lat + rope), float("nan"), dtype=dtype)
    table = torch.full((len(contexts), width), -1, dtype=torch.int32)
    taken = 0
    for b, c in enumerate(contexts):
        n = -(-c // block)
        table[b, :n] = order[taken:taken + n].int()
        taken += n
        pos = torch.arange(c)
        cache[table[b, pos // block].long(), pos % block] = randn(c, lat + rope, dtype=dtype, generator=gen)
    q_latent = randn(len(contexts), heads, lat, dtype=dtype, generator=gen)
    q_pe = randn(len(contexts), heads, rope, dtype=dtype, generator=gen)
    lens = torch.tensor(contexts, dtype=torch.int32)
    return q_latent, q_pe, cache, table, lens


def reference(q_latent, q_pe, cache, table, lens, scale):
    return paged_latent_decode(q_latent.double(), q_pe.double(), cache.double(), table, lens, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_splits_match_float64_reference(dtype, poison_empty):
    q_latent, q_pe, cache, table, lens = inputs(dtype)
    scale = (L + R) ** -0.5
    expected = reference(q_latent, q_pe, cache, table, lens, scale)
    for splits in (1, 2, 3, 5):
        got = kernel.mla_decode_splits(q_latent, q_pe, cache, table, lens, scale, splits)
        assert got.dtype == dtype and got.shape == q_latent.shape
        assert torch.equal(got[-1], torch.zeros_like(got[-1])), "an empty context gives zeros"
        close(got, expected, dtype, f"{splits} splits")


#: (config, heads, cache block size, L, R): several head blocks with a partial last one (20 heads
#: in blocks of 16), one block of 32 for 20 heads, tiles of 16 rows inside blocks of 48 (the
#: contiguous path at offsets 0, 16, 32), tiles of 32 over blocks of 16 and 48 (the per-position
#: lookup), 4 warps and 1 stage, L and R that are not powers of two (masked lanes)
CONFIGS = [
    (kernel.Config(16, 16, 4, 2), 20, 16, L, R),
    (kernel.Config(32, 16, 8, 3, 0.5), 20, 48, L, R),
    (kernel.Config(16, 32, 4, 1), 20, 16, L, R),
    (kernel.Config(16, 32, 8, 2), 4, 48, 40, 8),
    (kernel.Config(16, 16, 4, 2), 4, 48, 40, 8),
    # two value halves a head block: lanes 0-15 / 16-31, and L=40 over 64 lanes (the second half
    # mostly masked), with the per-position lookup
    (kernel.Config(16, 16, 4, 2, v_splits=2), 20, 16, L, R),
    (kernel.Config(16, 32, 8, 2, v_splits=2), 4, 48, 40, 8),
]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", CONFIGS, ids=lambda c: f"{c[0]}-H{c[1]}-bs{c[2]}-L{c[3]}R{c[4]}")
def test_configs_match_float64_reference(case, dtype, poison_empty):
    """Every tile path under ``override``, through the launcher and with 3 splits; contexts
    that are not multiples of the tile or the block, and an empty row."""
    cfg, heads, block, lat, rope = case
    q_latent, q_pe, cache, table, lens = inputs(dtype, (70, 0, 17, 33), seed=3, heads=heads, block=block,
                                                lat=lat, rope=rope)
    scale = (lat + rope) ** -0.5
    expected = reference(q_latent, q_pe, cache, table, lens, scale)
    with kernel.override(cfg):
        assert kernel.config(dtype, heads, block, torch.device("cpu")) is cfg
        got = kernel.mla_decode(q_latent, q_pe, cache, table, lens, 70, scale)
    assert kernel.config(dtype, heads, block, torch.device("cpu")) == kernel.tiles(dtype, heads, block, True), "restored"
    assert torch.equal(got[1], torch.zeros_like(got[1])), "an empty context gives zeros"
    close(got, expected, dtype, f"{cfg} launcher")
    close(kernel.mla_decode_splits(q_latent, q_pe, cache, table, lens, scale, 3, cfg), expected, dtype, f"{cfg} 3 splits")


def test_value_splits_need_two_dot_widths():
    with pytest.raises(ValueError, match="v_splits must be 1 or 2"):
        kernel.Config(64, 64, 8, 2, v_splits=4)
    q_latent, q_pe, cache, table, lens = inputs(torch.float32, (5,), lat=8, rope=16)
    with pytest.raises(ValueError, match="two value halves need at least 32 latent lanes"):
        kernel.mla_decode_splits(q_latent, q_pe, cache, table, lens, 0.3, 1, kernel.Config(16, 16, 4, 2, v_splits=2))


def test_default_tiles():
    """The Hopper tiles for DeepSeek-V3 (128 heads, blocks of 64) and what changes them."""
    assert kernel.tiles(torch.bfloat16, 128, 64, hopper=True) == kernel.Config(64, 64, 8, 2, 1.0)
    assert kernel.tiles(torch.bfloat16, 16, 64, hopper=True) == kernel.Config(16, 32, 4, 2, 1.0)  # TP8: 16 heads
    assert kernel.tiles(torch.bfloat16, 128, 16, hopper=True).block_n == 16  # stays inside a block
    assert kernel.tiles(torch.float32, 128, 64, hopper=True).block_h == 16
    assert kernel.tiles(torch.bfloat16, 128, 64, hopper=False, hip=True).warps == 4


def test_short_splits_take_value_halves():
    """``choose``: the Hopper tiles give way to HALVES when their splits hold at most
    HALVES_MAX_SPLIT positions (the CPU counts as 64 units: 2 head blocks x 32 splits)."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    hopper = kernel.tiles(bf16, 128, 64, hopper=True)
    assert kernel.choose(bf16, 1, 128, 512, 4096, 64, cpu) == (kernel.HALVES, 16)  # 32 splits of 128
    assert kernel.choose(bf16, 1, 128, 512, 1024, 64, cpu) == (kernel.HALVES, 16)
    assert kernel.choose(bf16, 1, 128, 512, 4097, 64, cpu) == (hopper, 32)  # 129 positions a split
    assert kernel.choose(bf16, 1, 128, 512, 32768, 64, cpu) == (hopper, 32)
    assert kernel.choose(bf16, 64, 128, 512, 100, 64, cpu) == (hopper, 1)  # HALVES: 256 programs, two waves
    assert kernel.choose(bf16, 16, 128, 512, 100, 64, cpu) == (kernel.HALVES, 1)  # 64 programs
    assert kernel.choose(bf16, 1, 128, 16, 4096, 64, cpu)[0] == hopper  # too narrow to halve
    assert kernel.choose(bf16, 1, 16, 512, 4096, 64, cpu)[0] == kernel.tiles(bf16, 16, 64, hopper=True)
    assert kernel.choose(torch.float32, 1, 128, 512, 4096, 64, cpu)[0] == kernel.tiles(torch.float32, 128, 64, True)
    forced = kernel.Config(64, 64, 8, 2, 1.0)
    with kernel.override(forced):
        assert kernel.choose(bf16, 1, 128, 512, 4096, 64, cpu) == (forced, 32)


def test_launcher_and_strided_inputs(poison_empty):
    q_latent, q_pe, cache, table, lens = inputs(torch.bfloat16, (70, 33, 5), seed=1)
    scale = 0.3
    expected = reference(q_latent, q_pe, cache, table, lens, scale)
    close(kernel.mla_decode(q_latent, q_pe, cache, table, lens, 70, scale), expected, torch.bfloat16, "max_seq_len 70")
    close(kernel.mla_decode(q_latent, q_pe, cache, table, lens, 0, scale), expected, torch.bfloat16, "unknown max")
    # q as views of one [B, N, L + R] query (the layer's absorbed layout), the table wider than needed
    q = torch.cat((q_latent, q_pe), dim=-1)
    wide = torch.cat((table, torch.full_like(table, -1)), dim=1)
    close(kernel.mla_decode(q[..., :L], q[..., L:], cache, wide, lens, 0, scale), expected, torch.bfloat16, "views")


def test_num_splits():
    cpu = torch.device("cpu")  # 64 compute units
    cfg = kernel.tiles(torch.bfloat16, 128, 64, hopper=True)
    assert kernel.num_splits(64, 128, 4096, cpu, cfg) == 1
    assert kernel.num_splits(1, 128, 32768, cpu, cfg) == 32  # 2 head blocks x 32 splits: one per unit
    assert kernel.num_splits(1, 128, 64, cpu, cfg) == 1  # one tile's context is not split
    assert kernel.num_splits(1, 128, 100, cpu, cfg) == 2
    assert kernel.num_splits(3, 128, 4096, cpu, cfg) == 8  # 6 programs: 11 splits, rounded down
    assert kernel.num_splits(1, 1, 10 ** 7, cpu, cfg) == kernel.MAX_SPLITS
    assert kernel.num_splits(1, 128, 32768, cpu, kernel.Config(64, 32, 8, 2, 2.0)) == 64
    # the fewest positions a split gets bounds the split count of short contexts
    assert kernel.num_splits(1, 128, 4096, cpu, kernel.Config(64, 64, 8, 2, 1.0, 256)) == 16
    assert kernel.num_splits(1, 128, 4096, cpu, kernel.Config(64, 64, 8, 2, 1.0, 64)) == 32
    assert kernel.num_splits(1, 128, 1024, cpu, kernel.Config(64, 64, 8, 2, 1.0, 64)) == 16


def test_bad_inputs():
    q_latent, q_pe, cache, table, lens = inputs(torch.float32, (5, 3))
    with pytest.raises(ValueError, match="customop::mla_decode: kv_cache must be"):
        kernel.mla_decode(q_latent, q_pe, cache[..., :-1], table, lens, 0, 1.0)
    with pytest.raises(ValueError, match="customop::mla_decode: block_table must be"):
        kernel.mla_decode(q_latent, q_pe, cache, table.float(), lens, 0, 1.0)
    with pytest.raises(ValueError, match="customop::mla_decode: seq_lens must be"):
        kernel.mla_decode(q_latent, q_pe, cache, table, lens[:1], 0, 1.0)
    with pytest.raises(TypeError, match="customop::mla_decode: q_latent and q_pe"):
        kernel.mla_decode(q_latent, q_pe.half(), cache, table, lens, 0, 1.0)


def test_opcheck():
    """The library op's schema and fake, on its reference and with the kernel as the CPU kernel."""
    args = (*inputs(torch.float32, (17, 0, 5)), 17, 0.25)
    torch.library.opcheck(torch.ops.customop.mla_decode.default, args)
    with as_cpu_kernel("mla_decode", kernel.mla_decode):
        torch.library.opcheck(torch.ops.customop.mla_decode.default, args)


# ---- the layer through forward_kernel ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_forward_kernel(dtype):
    from customop.ops.mla import MultiHeadLatentAttentionWrapper
    from customop.samples.mla import BATCHES, build_modules, init_kwargs
    from tests.cases.mla import reference as layer_reference
    from tests.ops.test_mla import close as layer_close

    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(True, dtype), True))
    batch = BATCHES[0]  # decodes with long contexts, a chunked prefill and a fresh prefill
    positions, hidden, cache, meta = batch.build(dtype)
    assert meta.num_decodes > 0
    expected, _ = layer_reference(op, positions, hidden, cache.clone(), meta)
    with torch.no_grad(), as_cpu_kernel("mla_decode", kernel.mla_decode) as calls:
        got = op.forward_kernel(positions, hidden, cache, meta)
    assert calls, "the kernel ran"
    layer_close(got, expected, dtype, f"{batch.label} forward_kernel")


def test_decode_equals_prefill_through_the_kernel():
    from customop.samples.mla import OneRequest

    dtype = torch.float32
    seq = OneRequest(dtype)
    with torch.no_grad(), as_cpu_kernel("mla_decode", kernel.mla_decode) as calls:
        whole = seq.step(seq.fresh(), 0, 9, decode=False)
        cache = seq.fresh()
        parts = [seq.step(cache, 0, 5, decode=False)] + [seq.step(cache, t, 1, decode=True) for t in range(5, 9)]
        # two decode tokens of one request in one step stay causal
        cache2 = seq.fresh()
        two = [seq.step(cache2, 0, 7, decode=False), seq.step(cache2, 7, 2, decode=True)]
    assert len(calls) == 5
    assert_close(torch.cat(parts), whole, dtype, what="decode vs prefill")
    assert_close(torch.cat(two), whole, dtype, what="two decode tokens vs prefill")


# ---- compiled for the GPUs (no GPU needed) --------------------------------------------------------
# The interpreter says nothing of registers: compile both kernels at the DeepSeek-V3 configuration
# the launcher picks (L=512, R=64, blocks of 64) for the H200 (sm_90: no spills but HALVES') and MI300, in a
# subprocess with TRITON_INTERPRET=0. Pointers and strides are marked 16-divisible, as Triton
# specializes them at a real launch (576-lane rows), so the cache loads compile as they will run.
_ALIGNED = ("Q", "QPE", "C", "BT", "SL", "MID_O", "MID_LSE", "O", "stride_qb", "stride_qh", "stride_pb", "stride_ph",
            "stride_cb", "stride_cs", "stride_tb", "stride_ob", "stride_oh")


def _aot_cases():
    """(label, kernel, {pointer arg: type}, constexprs, warps); other arguments are i32. The
    default tiles for 128 heads: Hopper's bf16 (split and direct: one split writes the output)
    and fp32, the other GPUs' bf16; the merge of 64 and of 2 splits."""
    halves = kernel.HALVES
    for label, dtype, ptr, hopper, direct, cfg in (
            ("hopper bf16", torch.bfloat16, "*bf16", True, False, None),
            ("hopper bf16 direct", torch.bfloat16, "*bf16", True, True, None),
            ("hopper bf16 halves", torch.bfloat16, "*bf16", True, False, halves),
            ("fp32", torch.float32, "*fp32", True, False, None),
            ("other bf16", torch.bfloat16, "*bf16", False, False, None)):
        cfg = cfg or kernel.tiles(dtype, 128, 64, hopper)
        types = {"Q": ptr, "QPE": ptr, "C": ptr, "BT": "*i32", "SL": "*i32", "MID_O": "*fp32", "MID_LSE": "*fp32",
                 "O": ptr, "qk_scale": "fp32"}
        yield (f"split {label} {cfg}", kernel._split_kernel, types,
               dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, BLOCK_SIZE=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                    STAGES=cfg.stages, V_SPLITS=cfg.v_splits, BLOCK_V=512 // cfg.v_splits, DIRECT=direct,
                    PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    UPCAST=False), cfg.warps)
    for block_s in (64, 2):
        yield (f"merge {block_s}", kernel._merge_kernel, {"MID_O": "*fp32", "MID_LSE": "*fp32", "O": "*bf16"},
               dict(L=512, BLOCK_L=512, BLOCK_S=block_s, BLOCK_LM=min(512, kernel._MERGE_TILE // block_s)), 4)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_kernels_compile_for_the_gpus(target):
    # HALVES (one warpgroup, a [64, 256] fp32 accumulator) spills ~200 bytes a thread on sm_90
    # (Triton 3.6 and 3.7) and is still the H200's fastest at the short splits it is chosen for
    # (BENCHMARKS.md, 2026-12-03)
    halves = f"split hopper bf16 halves {kernel.HALVES}"
    aot_subprocess.assert_compiles_for("tests.backends.triton.test_mla_triton", target, len(list(_aot_cases())),
                                       spill_ok={halves: 256})


if __name__ == "__main__":
    aot_subprocess.main(_aot_cases(), _ALIGNED)
