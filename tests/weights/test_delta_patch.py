"""The one checked apply of sparse deltas (``_codec.patch.apply_patches``) that the stream
subscriber and the mesh generator rank both use: every patch or none, whether the patches go
in one pass (undone on a failure) or are checked first (scratch too small), or some of each."""

from __future__ import annotations

import pytest
import torch

from transport._native import delta as native
from transport.weights import DeltaRefusedError
from transport.weights._codec.format import MASK64, SPARSE_MAX, Kind
from transport.weights._codec.patch import Patch, Scratch, apply_patches

N = 50_000


def _case(seed: int, dtype: torch.dtype, fraction: float,
          terms: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Patch]:
    """(live base, fresh, payload, patch) for a tensor of which ``fraction`` changed (``terms``:
    the patch gives the base values' checksum terms, as the stream form's header does)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=g).to(dtype)
    fresh = base.clone()
    at = torch.randperm(N, generator=g)[: int(N * fraction)]
    fresh[at] += 1.0
    es = base.element_size()
    out = torch.zeros(N * es, dtype=torch.uint8)
    r = native.encode(fresh.data_ptr(), base.data_ptr(), 0, N, es, out.data_ptr(), out.numel())
    assert r.kind in (Kind.VARINT, Kind.BITMASK) and r.changed == len(at)
    held = native.checksum(base.data_ptr(), N, es)
    new_sum = native.checksum(fresh.data_ptr(), N, es)
    assert (held - r.sum_old + r.sum_new) & MASK64 == new_sum
    live = base.clone()
    patch = Patch(f"t{seed}", live.data_ptr(), N, es, out.data_ptr(), r.payload_bytes, r.pos_bytes, Kind(r.kind),
                  r.changed, held, new_sum, r.sum_old if terms else None)
    return live, fresh, out, patch


def _cases(terms: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Patch]]:
    return [_case(1, torch.bfloat16, 0.01, terms), _case(2, torch.float32, 0.3, terms),
            _case(3, torch.bfloat16, 0.002, terms)]


# scratch for none of them (every patch checked first), for the first only (some of each), for all
SCRATCH = {"checked-first": 0, "mixed": 1, "one-pass": 3}


@pytest.mark.parametrize("terms", [False, True], ids=["read", "given"])
@pytest.mark.parametrize("mode", list(SCRATCH))
def test_every_patch_lands_bit_for_bit(mode, terms):
    cases = _cases(terms)
    scratch = Scratch(sum(c[3].scratch_bytes for c in cases[: SCRATCH[mode]]))
    apply_patches([c[3] for c in cases], 2, scratch)
    for live, fresh, _, _ in cases:
        assert torch.equal(live.view(torch.uint8), fresh.view(torch.uint8))


@pytest.mark.parametrize("mode", list(SCRATCH))
@pytest.mark.parametrize("poison", ["checksum", "positions", "half", "terms"])
def test_a_failing_patch_leaves_every_memory_as_it_was(mode, poison):
    """The last patch fails (a wrong promised checksum, positions past the tensor's end from
    the first or from half-way, or base terms that are not the base's): the others, stored in
    the same pass or not, are undone or never stored; so are the last one's own stores before
    its refusal (half-way: sparse enough that its positions are read a block ahead)."""
    cases = _cases(terms=poison == "terms")
    live, _, payload, bad = cases[-1]
    if poison == "checksum":
        bad = Patch(**{**bad.__dict__, "new_sum": (bad.new_sum + 1) & MASK64})
    elif poison == "terms":  # the sender's word on the values it replaces is wrong
        assert bad.old_terms is not None
        bad = Patch(**{**bad.__dict__, "old_terms": (bad.old_terms + 1) & MASK64})
    elif poison == "half":  # a patch that claims half its tensor: its later positions fall outside it
        bad = Patch(**{**bad.__dict__, "numel": N // 2})
    else:  # a patch that claims a tensor of 10 elements: its positions fall outside it
        bad = Patch(**{**bad.__dict__, "numel": 10})
    cases[-1] = (live, cases[-1][1], payload, bad)
    before = [c[0].clone() for c in cases]
    scratch = Scratch(sum(c[3].scratch_bytes for c in cases[: SCRATCH[mode]]))
    with pytest.raises(DeltaRefusedError, match="t3"):
        apply_patches([c[3] for c in cases], 2, scratch)
    for (now, *_), was in zip(cases, before, strict=True):
        assert torch.equal(now.view(torch.uint8), was.view(torch.uint8))


def _chain(poison: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Patch], list[torch.Tensor]]:
    """(live base, mid, fresh, [A, B], payloads): A turns base into mid, B mid into fresh, both
    on the same memory, and B changes many elements A changed (``poison``: B promises a wrong
    checksum)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(N, generator=g).to(torch.bfloat16)
    mid, fresh = base.clone(), base.clone()
    at = torch.randperm(N, generator=g)[: N // 50]
    mid[at] += 1.0
    fresh.copy_(mid)
    fresh[at[: len(at) // 2]] += 1.0  # half of A's positions again
    fresh[torch.randperm(N, generator=g)[: N // 100]] -= 1.0
    live = base.clone()
    patches, payloads = [], []
    for old, new in ((base, mid), (mid, fresh)):
        out = torch.zeros(N * 2, dtype=torch.uint8)
        r = native.encode(new.data_ptr(), old.data_ptr(), 0, N, 2, out.data_ptr(), out.numel())
        new_sum = native.checksum(new.data_ptr(), N, 2)
        if poison and new is fresh:
            new_sum = (new_sum + 1) & MASK64
        patches.append(Patch(f"p{len(patches)}", live.data_ptr(), N, 2, out.data_ptr(), r.payload_bytes, r.pos_bytes,
                             Kind(r.kind), r.changed, native.checksum(old.data_ptr(), N, 2), new_sum))
        payloads.append(out)
    return live, mid, fresh, patches, payloads


@pytest.mark.parametrize("mode", ["checked-first", "one-pass"])
def test_patches_of_one_memory_go_in_order_and_are_undone_last_first(mode):
    """Patches of the same memory (a mesh slot that every trainer rank patches, tied tensors)
    are applied one after the other in the order given, and when the last fails every value is
    restored: undone in the reverse order, the stores of the first are not left behind where
    the second stored over them."""
    live, _, fresh, patches, _keep = _chain(poison=False)
    big = sum(p.scratch_bytes for p in patches)
    scratch = Scratch(0 if mode == "checked-first" else big)
    if mode == "checked-first":
        # Checked first, each against the memory as it is now: the second one's base is the
        # first one's result, which is not there yet, so the two are refused together.
        with pytest.raises(DeltaRefusedError, match="p1"):
            apply_patches(patches, 2, scratch)
        return
    apply_patches(patches, 2, scratch)
    assert torch.equal(live.view(torch.uint8), fresh.view(torch.uint8))
    live, _, _, patches, _keep = _chain(poison=True)
    before = live.clone()
    with pytest.raises(DeltaRefusedError, match="p1"):
        apply_patches(patches, 2, Scratch(big))
    assert torch.equal(live.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_scratch_for_deltas_applies_the_densest_sparse_delta_in_one_pass(dtype):
    # The densest change the encoder still sends sparse (its payload capped at SPARSE_MAX of the
    # tensor, as the publisher caps it): past the eighth readied ahead, within the scratch's
    # bound, and applied in one pass (the scratch grew to it), not checked first.
    es = torch.empty(0, dtype=dtype).element_size()
    cap = int(N * es * SPARSE_MAX) // 8 * 8
    g = torch.Generator().manual_seed(7)
    base = torch.randn(N, generator=g).to(dtype)
    densest = None
    for percent in range(5, 100, 5):
        fresh = base.clone()
        fresh[torch.randperm(N, generator=g)[: N * percent // 100]] += 1.0
        out = torch.zeros(cap, dtype=torch.uint8)
        r = native.encode(fresh.data_ptr(), base.data_ptr(), 0, N, es, out.data_ptr(), cap)
        if r.kind not in (Kind.VARINT, Kind.BITMASK):
            break
        densest = fresh, out, r
    assert densest is not None
    fresh, out, r = densest
    live = base.clone()
    patch = Patch("t", live.data_ptr(), N, es, out.data_ptr(), r.payload_bytes, r.pos_bytes, Kind(r.kind), r.changed,
                  native.checksum(base.data_ptr(), N, es), native.checksum(fresh.data_ptr(), N, es), None)
    scratch = Scratch.for_deltas(N * es, 1, least=0)
    scratch.ready()
    assert scratch.take(0).numel() == scratch.ready_bytes == N * es // 8 < patch.scratch_bytes <= scratch.max_bytes
    apply_patches([patch], 2, scratch)
    assert torch.equal(live.view(torch.uint8), fresh.view(torch.uint8))
    assert scratch.take(0).numel() >= patch.scratch_bytes
