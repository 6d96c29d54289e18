"""``MultiHeadLatentAttentionWrapper`` (``multi_head_latent_attention``): DeepSeek-V2/V3 MLA, vLLM
0.33's class, constructor and ``MLAModules``, with the KV cache and the batch layout passed in.

vLLM's layer finds its latent cache and batch metadata in a forward context; customop has none,
so ``forward(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling=None)`` takes them:
``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (written in place with
this batch's rows) and an ``MLAMetadata`` (``customop/math/mla.py``). Without metadata (vLLM's
profile run) the attention output is zeros.

The layer (vLLM's order): q through ``q_lora`` (``fused_qkv_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``) or ``q_proj``; ``kv_a`` -> ``[kv_c | k_pe]``, ``kv_c`` normalised; RoPE (the given
module, GPT-J style for DeepSeek) on the last ``qk_rope_head_dim`` lanes of every query head and on
``k_pe``; ``llama_4_scaling``; attention (decode requests absorbed over the latent rows, prefill
requests up-projected: the math module); ``o_proj``. Submodules are the caller's (customop's
``ReplicatedLinear``/``ColumnParallelLinear``, ``RMSNorm``, ``get_rope``... or any module with their
call forms: linear layers may return ``(out, bias)`` tuples). Accelerators (``forward_kernel``)
send the decode requests' latent attention to ``torch.ops.customop.mla_decode`` (a Triton
split-context kernel: docs/mla.md) and the prefill requests without cached context, packed, to one
causal ``torch.ops.customop.varlen_attn`` (the varlen attention route of ``mm_encoder_attn``); the
rest (chunked prefills, the projections) is the spec. Sparse (V3.2 indexer) models are not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from customop.backends.cpu.mla import latent_decode_by_rows
from customop.custom_op import CustomOp
from customop.math.mla import MLADims, MLAMetadata, mla_attention  # noqa: F401  (re-exported)
from customop.ops.linear import cpu_linear

_OP = "customop.multi_head_latent_attention"


@dataclasses.dataclass
class MLAModules:
    """The submodules the model builds (vLLM's fields; the sparse ones must stay unset)."""

    kv_a_layernorm: nn.Module
    kv_b_proj: nn.Module
    rotary_emb: nn.Module | None
    o_proj: nn.Module
    fused_qkv_a_proj: nn.Module | None
    kv_a_proj_with_mqa: nn.Module | None
    q_a_layernorm: nn.Module | None
    q_b_proj: nn.Module | None
    q_proj: nn.Module | None
    indexer: nn.Module | None = None
    is_sparse: bool = False
    topk_indices_buffer: torch.Tensor | None = None
    indexer_rotary_emb: nn.Module | None = None


def _out(result: Any) -> torch.Tensor:
    """A linear layer's output whether it returns ``out`` or vLLM's ``(out, bias)``."""
    return result[0] if isinstance(result, tuple) else result


@CustomOp.register("multi_head_latent_attention")
class MultiHeadLatentAttentionWrapper(CustomOp):
    """DeepSeek MLA over a paged latent cache (see the module docstring). ``cache_config``,
    ``quant_config``, ``prefix`` and ``skip_topk`` are accepted for vLLM's signature."""

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: int | None, kv_lora_rank: int, mla_modules: MLAModules,
                 cache_config: object = None, quant_config: object = None, prefix: str = "", skip_topk: bool = False,
                 *, enforce_enable: bool = False) -> None:
        m = mla_modules
        if m.is_sparse or m.indexer is not None:
            raise NotImplementedError(f"{_OP}: sparse MLA (the V3.2 indexer) is not implemented")
        needs = ("fused_qkv_a_proj", "q_a_layernorm", "q_b_proj") if q_lora_rank is not None else ("kv_a_proj_with_mqa", "q_proj")
        missing = [name for name in needs if getattr(m, name) is None]
        if missing:
            raise ValueError(f"{_OP}: q_lora_rank={q_lora_rank} needs mla_modules.{', .'.join(missing)}")
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size, self.num_heads, self.prefix = hidden_size, num_heads, prefix
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.dims = MLADims(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, float(scale))
        for name in ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj", "q_proj",
                     "kv_a_layernorm", "kv_b_proj", "rotary_emb", "o_proj"):
            setattr(self, name, getattr(m, name))

    # ---- checks -----------------------------------------------------------------------------------

    def check_inputs(self, positions: Any, hidden_states: Any, kv_cache: Any, meta: Any) -> None:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"{_OP}: hidden_states must be [tokens, {self.hidden_size}], got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        tokens = hidden_states.shape[0]
        if not isinstance(positions, torch.Tensor) or positions.shape != (tokens,):
            raise ValueError(f"{_OP}: positions must be [{tokens}], got {getattr(positions, 'shape', positions)}")
        if meta is None:
            return
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(f"{_OP}: kv_cache must be [num_blocks, block_size, {width}], got "
                             f"{getattr(kv_cache, 'shape', kv_cache)}")
        blocks, block_size = kv_cache.shape[:2]
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != tokens or any(b < a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"{_OP}: query_start_loc {starts} must rise from 0 to the {tokens} tokens, one entry per request + 1")
        if not 0 <= meta.num_decodes <= len(lens) or meta.block_table.shape[0] != len(lens):
            raise ValueError(f"{_OP}: {len(lens)} requests but num_decodes={meta.num_decodes} and a block table "
                             f"of {meta.block_table.shape[0]} rows")
        if meta.slot_mapping.shape != (tokens,) or (tokens and int(meta.slot_mapping.max()) >= blocks * block_size):
            raise ValueError(f"{_OP}: slot_mapping must be [{tokens}] slots below {blocks * block_size} (the cache's)")
        table = meta.block_table
        for r, length in enumerate(lens):
            q_len = starts[r + 1] - starts[r]
            used = -(-length // block_size)
            if length < q_len or used > table.shape[1]:
                raise ValueError(f"{_OP}: request {r} has {q_len} new tokens in a context of {length}, which needs "
                                 f"{used} blocks of the block table's {table.shape[1]}")
            ids = table[r, :used]
            if used and (int(ids.min()) < 0 or int(ids.max()) >= blocks):
                raise ValueError(f"{_OP}: cache block table out of range: request {r} uses blocks {ids.tolist()}, "
                                 f"the cache has {blocks}")

    # ---- the layer -------------------------------------------------------------------------------

    def _qkv(self, positions: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, N, P + R] roped, kv_c_normed [T, L], k_pe [T, R] roped)``."""
        if self.q_lora_rank is not None:
            q_c, kv_lora = _out(self.fused_qkv_a_proj(h)).split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], -1)
            q = _out(self.q_b_proj(self.q_a_layernorm(q_c)))
        else:
            kv_lora, q = _out(self.kv_a_proj_with_mqa(h)), _out(self.q_proj(h))
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        if self.rotary_emb is None:
            return q, kv_c_normed, k_pe
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        tokens = q.shape[0]
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(tokens, -1).clone(), k_pe.reshape(tokens, -1).clone())
        return torch.cat((q_nope, q_pe.view(tokens, self.num_heads, -1)), dim=-1), kv_c_normed, k_pe.reshape(tokens, -1)

    def forward_native(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor | None = None,
                       attn_metadata: MLAMetadata | None = None,
                       llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        return self._layer(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling)

    def forward_cuda(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor | None = None,
                     attn_metadata: MLAMetadata | None = None,
                     llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_kernel(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling)

    forward_xpu = forward_tpu = forward_cuda

    def forward_cpu(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor | None = None,
                    attn_metadata: MLAMetadata | None = None,
                    llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        """``forward_kernel``'s route with CPU pieces: the decode requests' latent attention for
        the whole batch through ``latent_decode_by_rows`` (``backends/cpu/mla.py``: the weights
        absorbed once, each row's history gathered by blocks, fp32 scores and softmax), the fresh
        prefills packed through ``customop::varlen_attn`` (its CPU body: one causal SDPA per prompt,
        no explicit mask), chunked prefills as in the spec, the prefills' ``kv_b_proj``
        up-projection on ``cpu_linear`` (in bf16 on AVX2 CPUs an fp32 GEMM: it was 225 of 530 ms
        of a 512-token prompt). Measured 1.0-2.2x the spec and its
        compile (benchmarks/results/cpu_mla.md). Inside a caller's ``torch.compile`` the spec's
        walk runs (``customop::mla_attention``), as for every op."""
        if torch.compiler.is_compiling():
            return self.forward_native(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling)
        return self._layer(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling,
                           latent_decode=latent_decode_by_rows, varlen_attn=torch.ops.customop.varlen_attn,
                           linear=cpu_linear)

    def forward_kernel(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor | None = None,
                       attn_metadata: MLAMetadata | None = None,
                       llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        """The spec, with the decode requests' latent attention through ``torch.ops.customop.mla_decode``
        (the Triton split-context kernel on GPUs) and the prefill requests without cached context
        through one causal ``torch.ops.customop.varlen_attn`` over their packed tokens; a prefill
        with cached context (chunked prefill) stays as in the spec. While autograd records, the
        spec runs throughout (the library ops have no backward)."""
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.kv_b_proj.weight.requires_grad):
            return self.forward_native(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling)
        return self._layer(positions, hidden_states, kv_cache, attn_metadata, llama_4_scaling,
                           latent_decode=torch.ops.customop.mla_decode, varlen_attn=torch.ops.customop.varlen_attn)

    def _layer(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor | None,
               attn_metadata: MLAMetadata | None, llama_4_scaling: torch.Tensor | None,
               latent_decode: Any = None, varlen_attn: Any = None, linear: Any = F.linear) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        # the batch checks read the metadata on the host: a traced graph cannot (the opaque op below
        # then runs unchecked, as vLLM's attention backends do)
        self.check_inputs(positions, hidden_states, kv_cache, None if compiling else attn_metadata)
        q, kv_c_normed, k_pe = self._qkv(positions, hidden_states)
        if llama_4_scaling is not None:
            q = q * llama_4_scaling
        if attn_metadata is None:  # vLLM's profile run: no cache, a zero attention output
            attn = q.new_zeros(q.shape[0], self.num_heads * self.v_head_dim)
        elif compiling:  # the per-request walk as one node (customop::mla_attention)
            m, d = attn_metadata, self.dims
            attn = torch.ops.customop.mla_attention(
                q, kv_c_normed, k_pe, kv_cache, m.slot_mapping, m.block_table, m.seq_lens, m.query_start_loc,
                self.kv_b_proj.weight, m.num_decodes, d.sizes, d.scale, latent_decode is not None)
        else:
            attn = mla_attention(q, kv_c_normed, k_pe, kv_cache, attn_metadata, self.kv_b_proj.weight, self.dims,
                                 latent_decode, varlen_attn, linear)
        return _out(self.o_proj(attn))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim="
                f"{self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}")
