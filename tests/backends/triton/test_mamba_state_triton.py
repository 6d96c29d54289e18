"""The state-space cache contract with the real Triton kernels (under the interpreter): the bodies
of tests/ops/test_mamba_state.py's cache tests run on ``forward_kernel`` while every state-space
op has its Triton launcher as its CPU kernel (there, on CPU tensors, ``forward_kernel`` reaches
the ops' reference bodies). Prefill then token-by-token decode == one prefill; a chunked prefill
continuing from the cached state; a varlen batch == each request alone; the NaN-poisoned null
and spare slots never read or written. On top of those bodies' own comparisons (path against
itself, ``MIXER_TOLERANCE``), every single call is checked against the float64 reference
(tests/cases/mamba.py): its output and every cache slot afterwards, and that the launchers its
batch needs ran. Also Falcon-H1's ``mup_vector`` on the kernels (that body compares with the
reference itself).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from customop.math import mamba as spec
from customop.samples.mamba import BY_LABEL, Batch
from tests.backends.triton.test_mamba_triton import triton_kernels
from tests.cases.mamba import assert_matches, reference
from tests.ops import test_mamba_state as state

pytestmark = pytest.mark.interpret

CASES, IDS = state.CASES, state.IDS  # MambaMixer, MambaMixer2 (2 groups, 1 group), ShortConv; "small" tier
PATH = "forward_kernel"


@dataclasses.dataclass(frozen=True)
class _SlotBatch(Batch):
    """A ``Batch`` with the slots a test chose (the table's hands them out in reverse order)."""

    decode_slots: tuple[int, ...] = ()
    prefill_slots: tuple[int, ...] = ()

    def slots(self) -> tuple[list[int], list[int]]:
        return list(self.decode_slots), list(self.prefill_slots)


def _reference(case, op, h, caches, meta):
    """The float64 ``(output, *caches)`` of one call described by ``meta``. Padding is the
    reference's: a decode on slot 0 (``PAD_SLOT_ID`` too) runs from zero and writes nothing; a
    padding prefill (slot < 0 or the null slot) runs from zero into a scratch slot appended here
    and dropped again."""
    decode = [] if meta.decode_slots is None else [0 if s < 0 else s for s in meta.decode_slots.tolist()]
    lens, slots, inits = [], [], []
    if meta.num_prefills:
        qsl = meta.query_start_loc_p.tolist()
        lens = [b - a for a, b in zip(qsl, qsl[1:])]
        scratch = caches[0].shape[0]
        for slot, init in zip(meta.state_indices_tensor_p.tolist(), meta.has_initial_states_p.tolist()):
            pad = spec.is_padding(slot)
            slots.append(scratch if pad else slot)
            inits.append(bool(init) and not pad)
    batch = _SlotBatch("call", decodes=len(decode), prefill_lens=tuple(lens), has_initial_state=tuple(inits),
                       pad_rows=h.shape[0] - meta.num_actual_tokens, decode_slots=tuple(decode),
                       prefill_slots=tuple(slots))
    padded = [torch.cat([c, torch.zeros_like(c[:1])]) for c in caches]
    out, *expected = reference(case, op, batch, h, *padded)
    return (out, *(e[:-1] for e in expected))


def _launchers(case, meta) -> set[str]:
    """The ``customop::`` ops a call of ``case`` on ``meta`` must reach."""
    want = {"mixer2_gated_rms_norm"} if case.op == "mamba_mixer2" else set()
    if meta.num_decodes:
        want |= {"causal_conv1d_update"} | ({"selective_state_update"} if case.op != "short_conv" else set())
    if meta.num_prefills:
        want |= {"causal_conv1d_fn"} | {"mamba_mixer": {"selective_scan"}, "mamba_mixer2": {"ssd_chunk_scan"}}.get(
            case.op, set())
    return want


@pytest.fixture
def triton_path(monkeypatch, case, poison_empty):
    """The test module's ``layer`` and ``call`` as the Triton path: Mamba-2's norm sub-op takes its
    kernel route (as on an accelerator; on CPU it would dispatch to forward_cpu), and each call
    runs the launchers (fresh ``torch.empty`` NaN) and is checked against the float64 reference.
    Yields the path name."""
    build_layer = state.layer

    def layer(case_, dtype=torch.float32):
        op = build_layer(case_, dtype)
        if case_.op == "mamba_mixer2":
            op.norm._forward_method = op.norm.forward_kernel
        return op

    def call(op, path, h, caches, meta):
        expected = _reference(case, op, h, caches, meta)
        with triton_kernels() as calls:
            out = getattr(op, path)(h, *caches, meta)
        missing = _launchers(case, meta) - {name for name, c in calls.items() if c}
        assert not missing, f"the Triton launchers of {sorted(missing)} did not run"
        assert_matches((out, *caches), expected, h.dtype, what=f"{case.label} (Triton) vs float64")
        return out

    monkeypatch.setattr(state, "layer", layer)
    monkeypatch.setattr(state, "call", call)
    yield PATH


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prefill_then_decode_equals_one_prefill(case, triton_path):
    state.test_prefill_then_decode_equals_one_prefill(case, triton_path)


@pytest.mark.parametrize("split", [1, 2, 5, 7], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chunked_prefill_continues_from_the_cache(case, split, triton_path):
    state.test_chunked_prefill_continues_from_the_cache(case, triton_path, split)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_varlen_batch_equals_each_request_alone(case, triton_path):
    state.test_varlen_batch_equals_each_request_alone(case, triton_path)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_padding_and_unused_slots_are_never_read_or_written(case, triton_path):
    state.test_padding_and_unused_slots_are_never_read_or_written(case, triton_path)


@pytest.mark.parametrize("case", [BY_LABEL["mamba_mixer2"]], ids=["mamba_mixer2"])
def test_mamba2_mup_vector(case, triton_path):
    with triton_kernels() as calls:
        state.test_mamba2_mup_vector(triton_path)
    assert calls["ssd_chunk_scan"] and calls["selective_state_update"], "the Triton launchers did not run"
