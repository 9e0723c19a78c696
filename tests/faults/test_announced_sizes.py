"""What a peer's announcements may cost a real target: what it sent, never what it announced.

A PUTR / GETR frame announces its run table's size (up to 65,536 runs, 1 MiB) before a byte of
it arrives, a whole table of valid runs announces up to 65,536 places for data, and a staged
GETR asks for up to 4 MiB of reply. Each scenario of tests/peers/resource_probe.py runs against
a real target process (tests/peers/hostile_target.py) from this process's sockets, and the
target's resident memory is read from ``/proc``. Before the target's buffers grew only with the
bytes that arrived, 100 stalled tables cost +101 MiB, 20 whole tables of one-byte runs +274 MiB
(a view per run), and 100 unread staged replies +402 MiB (with Linux's default socket buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest

from tests.peers import resource_probe as probe
from tests.peers.resource_probe import grew


@pytest.fixture
def target(tmp_path, request):
    store = f"file://{tmp_path / 'store'}"
    t = probe.Target(tmp_path, store, sock_buf=getattr(request, "param", None))
    try:
        addr, incarnation = anyio.run(probe.agent_of, store, t.name)
        yield t, addr, incarnation
    finally:
        t.close()


@contextmanager
def stalled(target, scenario: Callable[..., dict[str, Any]], n: int) -> Iterator[dict[str, Any]]:
    """Runs ``scenario`` with ``n`` connections against the target and yields what it measured
    (none refused, the target alive); afterwards a legitimate peer's put still lands."""
    t, addr, inc = target
    doc = scenario(addr, t.name, inc, n, t.pid)
    assert doc["refused"] == 0 and t.alive()
    yield doc
    anyio.run(probe.legit_put_timed, t.store, t.name, None)


def test_stalled_run_tables_cost_what_arrived(target):
    """100 PUTRs announce 65,536 runs each (a 1 MiB table), send 16 bytes of it and stall."""
    with stalled(target, probe.runs_stall, 100) as doc:
        print(f"100 stalled run tables: +{grew(doc):.1f} MiB ({doc['sent_mib'] * 1024:.0f} KiB sent)")
        assert grew(doc) < 16, f"100 stalled run tables of 16 bytes sent cost {grew(doc):.0f} MiB"


def test_whole_run_tables_cost_about_what_arrived(target):
    """20 PUTRs send a whole table of 65,536 valid one-byte runs (1 MiB each), then stall
    before the data: the target holds the tables, not a view per run."""
    with stalled(target, probe.tables_stall, 20) as doc:
        print(f"20 whole run tables: +{grew(doc):.1f} MiB ({doc['sent_mib']:.1f} MiB sent)")
        assert grew(doc) < 2 * doc["sent_mib"] + 16, f"20 tables ({doc['sent_mib']:.0f} MiB) cost {grew(doc):.0f} MiB"


@pytest.mark.parametrize("target", [probe.SMALL_SOCK_BUF], indirect=True)
def test_unread_staged_replies_hold_one_part_each(target):
    """100 staged GETRs of 4 MiB whose replies are never read, against a target whose socket
    buffers are the Linux default size (so the kernel does not take the whole reply)."""
    with stalled(target, probe.replies_stall, 100) as doc:
        print(f"100 unread staged replies: +{grew(doc):.1f} MiB")
        assert grew(doc) < 48, f"100 unread 4 MiB replies cost {grew(doc):.0f} MiB"
