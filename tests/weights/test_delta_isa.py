"""$TRANSPORT_DELTA_ISA: a process started with it runs every default-ISA delta call on the path
it names, with the same encodings as the best path; a path this CPU lacks, or a value that names
none, fails those calls with a TransportInternalError naming the variable (explicit ``isa=``
calls are unaffected). Real child processes: the variable is read once per process."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests._support import PYTHON, python_env
from transport._native import delta as native

ROOT = Path(__file__).resolve().parents[2]
NAMES = {native.Isa.SCALAR: "scalar", native.Isa.AVX2: "avx2", native.Isa.AVX512: "avx512"}


def encode_seeded(isa: native.Isa = native.Isa.AUTO) -> list[list[object]]:
    """Encodes seeded bf16 tensors against a base with 0.5% and 20% of their elements changed (a
    varint and a bitmask payload), and checksums one without a base: per case the encoder's
    result with a digest of its payload bytes and of the snapshot it copied."""
    g = torch.Generator().manual_seed(11)
    n = 100_003
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    out = []
    for frac in (0.005, 0.2):
        fresh = base.clone()
        at = torch.randperm(n, generator=g)[: int(n * frac)]
        fresh[at] = torch.randn(len(at), generator=g).to(torch.bfloat16)
        snap = torch.empty_like(fresh)
        buf = torch.zeros(n, dtype=torch.uint8)  # half the dense bytes
        r = native.encode(fresh.data_ptr(), base.data_ptr(), snap.data_ptr(), n, 2, buf.data_ptr(), buf.numel(), isa)
        payload = hashlib.sha256(buf[: r.payload_bytes].numpy().tobytes()).hexdigest()
        out.append([int(r.kind), r.changed, r.payload_bytes, r.pos_bytes, r.sum_old, r.sum_new, payload,
                    hashlib.sha256(snap.view(torch.uint8).numpy().tobytes()).hexdigest()])
    out.append([native.checksum(base.data_ptr(), n, 2, 0, 0, isa)])
    return out


def scatter_seeded() -> list[list[object]]:
    """The checked scatter (scatter(), which runs on the default ISA) of seeded bitmask payloads
    of both element sizes, at densities from 1% to 90% and lengths that leave a tail past the
    vectors, plus two whose declared count is one off (refused before any store): per case the
    refusal and sums of the check pass with the live values read and with the payload alone, and
    the refusal and a digest of the live tensor after the write pass."""
    g = torch.Generator().manual_seed(5)
    out: list[list[object]] = []
    for es, dtype in ((2, torch.bfloat16), (4, torch.float32)):
        for n, frac, skew in ((100_003, 0.3, 0), (4_099, 0.9, 0), (77_777, 0.2, 0), (5_003, 0.5, 1),
                              (6_001, 0.5, -1)):
            base = torch.randn(n, generator=g).to(dtype)
            fresh = base.clone()
            at = torch.randperm(n, generator=g)[: int(n * frac)]
            fresh[at] = torch.randn(len(at), generator=g).to(dtype)
            buf = torch.zeros(n * es + 64, dtype=torch.uint8)
            r = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, es, buf.data_ptr(), buf.numel(),
                              native.Isa.SCALAR)
            assert r.kind == native.Kind.BITMASK, (n, frac)
            payload = buf[: r.payload_bytes].clone()
            live = base.clone()
            check = native.scatter(live.data_ptr(), n, es, payload.data_ptr(), payload.numel(), int(r.kind),
                                   r.changed + skew, r.pos_bytes, False)
            alone = native.scatter(0, n, es, payload.data_ptr(), payload.numel(), int(r.kind), r.changed + skew,
                                   r.pos_bytes, False)  # the payload alone: its new values' sums
            wrote = native.scatter(live.data_ptr(), n, es, payload.data_ptr(), payload.numel(), int(r.kind),
                                   r.changed + skew, r.pos_bytes, True)
            out.append([list(map(int, check)), list(map(int, alone)), int(wrote[0]),
                        hashlib.sha256(live.view(torch.uint8).numpy().tobytes()).hexdigest()])
    return out


def child(value: str, code: str) -> subprocess.CompletedProcess[str]:
    env = python_env()
    env["TRANSPORT_DELTA_ISA"] = value
    return subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


ENCODE = """
import json
from tests.weights.test_delta_isa import encode_seeded
from transport.weights import delta_isa
print(json.dumps([delta_isa(), encode_seeded()]))
"""

REFUSED = """
import json
from tests.weights.test_delta_isa import encode_seeded
from transport import TransportInternalError
from transport._native import delta as native
from transport.weights import delta_isa
got = []
for call in (delta_isa, encode_seeded):
    try:
        call()
        got.append(None)
    except TransportInternalError as exc:
        got.append(str(exc))
print(json.dumps([got, encode_seeded(native.Isa.SCALAR)]))
"""


def test_a_forced_isa_runs_every_default_call_with_the_same_encodings():
    if not native.supports(native.Isa.AVX2):
        pytest.skip("this CPU lacks AVX2")
    r = child("avx2", ENCODE)
    assert r.returncode == 0, r.stderr[-2000:]
    isa, encoded = json.loads(r.stdout)
    assert isa == "avx2"
    assert [case[0] for case in encoded[:2]] == [int(native.Kind.VARINT), int(native.Kind.BITMASK)]
    assert encoded == encode_seeded()  # in this process, on the default path


SCATTER = """
import json
from tests.weights.test_delta_isa import scatter_seeded
print(json.dumps(scatter_seeded()))
"""


def test_the_checked_scatter_of_a_bitmask_is_the_same_on_every_isa():
    # scatter() always runs on the default ISA: AVX2 and AVX-512 have their own vector walks of a
    # bitmask, the scalar path walks it a bit at a time.
    got = {}
    for isa in (i for i in (native.Isa.SCALAR, native.Isa.AVX2, native.Isa.AVX512) if native.supports(i)):
        r = child(NAMES[isa], SCATTER)
        assert r.returncode == 0, r.stderr[-2000:]
        got[isa] = json.loads(r.stdout)
    cases = got[native.Isa.SCALAR]
    assert [case[2] == int(native.Refusal.OK) for case in cases] == [True, True, True, False, False] * 2
    for isa, found in got.items():
        assert found == cases, NAMES[isa]


@pytest.mark.parametrize("value", ["bogus", "avx-512"])
def test_a_value_that_names_no_isa_fails_every_default_call_but_not_an_explicit_one(value):
    r = child(value, REFUSED)
    assert r.returncode == 0, r.stderr[-2000:]
    (best, encode), explicit = json.loads(r.stdout)
    for message in (best, encode):
        assert message is not None and f"TRANSPORT_DELTA_ISA='{value}'" in message, message
    assert explicit == encode_seeded(native.Isa.SCALAR)


@pytest.mark.parametrize("isa", [native.Isa.AVX2, native.Isa.AVX512], ids=lambda i: NAMES[i])
def test_a_forced_isa_this_cpu_lacks_fails_rather_than_running_another(isa):
    if native.supports(isa):
        pytest.skip(f"this CPU has {NAMES[isa]}")
    r = child(NAMES[isa], REFUSED)
    assert r.returncode == 0, r.stderr[-2000:]
    (best, encode), _ = json.loads(r.stdout)
    for message in (best, encode):
        assert message is not None and "lacks" in message and f"TRANSPORT_DELTA_ISA='{NAMES[isa]}'" in message
