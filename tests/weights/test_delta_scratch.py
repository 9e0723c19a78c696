"""The native diff's scratch (its varint positions and bitmask): leased from one pool for the
process, so a diff on a new thread (the publisher's copy threads are new for each pass) does not
fault its scratch in again, and readied ahead by ``reserve_scratch`` so that the first diff does
not either. Each case runs in a fresh process: the pool is the process's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

N = 1 << 25  # bf16 elements: a 4 MB bitmask, 1,024 pages

SCRIPT = textwrap.dedent("""
    import json, resource, sys, threading
    import torch
    from transport._native import delta as native

    n, reserve = int(sys.argv[1]), sys.argv[2] == "1"
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int16)
    fresh = base.clone()
    fresh[torch.randperm(n, generator=g)[: n * 3 // 100]] += 1
    out = torch.ones(n, dtype=torch.uint8)  # (written once: its pages are in)
    if reserve:
        native.reserve_scratch(1, n)

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    got = []

    def diff() -> None:
        f0 = faults()
        r = native.encode(fresh.data_ptr(), base.data_ptr(), 0, n, 2, out.data_ptr(), out.numel())
        got.append((faults() - f0, int(r.kind), int(r.changed)))

    for _ in range(2):  # each on a new thread, as the publisher's copy threads are
        t = threading.Thread(target=diff)
        t.start()
        t.join()
    print(json.dumps(got))
""")


def _diffs(reserve: bool) -> list[tuple[int, int, int]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(N), "1" if reserve else "0"], capture_output=True,
                          text=True, timeout=300, check=True)
    return [tuple(x) for x in json.loads(done.stdout)]


@pytest.mark.parametrize("reserve", [False, True], ids=["grown", "reserved"])
def test_a_diff_on_a_new_thread_reuses_the_scratch_and_a_reserved_one_is_not_faulted_in(reserve):
    (first, kind1, changed1), (second, kind2, changed2) = _diffs(reserve)
    assert kind1 == kind2 and changed1 == changed2 == N * 3 // 100
    # The bitmask alone is 1,024 pages; a diff that faults its scratch in takes more than that.
    assert second < 200, (first, second)  # a new thread, the scratch of the first diff
    if reserve:
        assert first < 200, first
    else:
        assert first > 1000, first
