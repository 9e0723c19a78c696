"""Several "hosts" on one machine, joined by shaped links: network namespaces, veth pairs and
one switch namespace with a bridge per fabric.

::

    with Fabric({"T": 2, "A": 1, "B": 1}, rate_mbit=1000) as fab:
        p = fab.popen("A", [PYTHON, "-m", "some.module", fab.addr("T", 0)])
        fab.link("T", 1, up=False)  # cut T's second NIC

Topology: each host is a namespace ``<prefix>-<host>-<tag>``; its NIC ``i`` is ``eth<i>``, one
end of a veth pair whose other end is a port of bridge ``br<i>`` in the switch namespace
``<prefix>-sw-<tag>``. NIC ``i`` of every host is on subnet ``10.<subnet>.<i + 1>.0/24``
(host number ``k``, in the order given, has ``.k + 1``), so NIC ``i`` of host P reaches NIC
``i`` of host Q and nothing else: two NICs of one host are two routable paths. The subnets exist
only inside the fabric's namespaces, so two fabrics at once (or the machine's own networks)
cannot clash. Every veth end, the host's and the switch's, has a ``tbf`` qdisc at ``rate_mbit``
on its egress: each direction of each link is shaped. Loopback is up in every namespace.

A process started with :meth:`Fabric.popen` runs in its host's namespace with a UTS namespace of
its own whose hostname is :meth:`Fabric.hostname` (``<host>-<tag>``): ``transport`` treats peers
with equal hostname, boot id and pid namespace as one host (same-host ``ipc`` between them), so
processes of one fabric host are one host to it and those of two are two. The command is
``ip netns exec NS unshare --uts sh -c 'hostname H && exec "$@"'``: ``ip`` and ``unshare``
exec, and the shell execs, so ``Popen.pid`` is the process itself (signals reach it).

Failure and cleanup: :meth:`Fabric.create` either builds the whole fabric or removes what it
made and raises; :meth:`Fabric.cleanup` (also run by ``__exit__``, on failure too) kills and reaps
every process :meth:`Fabric.popen` started that is still running, then deletes every namespace
(deleting a namespace destroys the veth pairs in it). Every command here has a timeout.
:class:`FabricUnavailableError` means namespaces cannot be made on this machine at all (not root,
no iproute2): tests skip on it (:func:`unavailable_reason`), anything else is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

_CMD_TIMEOUT_S = 30.0
_REAP_TIMEOUT_S = 30.0
DEFAULT_SUBNET = 79  # 10.79.<nic + 1>.0/24; tests/faults/test_network_partition.py uses 10.78.0.0/24


class FabricUnavailableError(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, or ``ip netns add``
    refused): a test skips on it; the message says which."""


class FabricError(RuntimeError):
    """A command that builds or changes the fabric failed; the message quotes it and its output."""


def unavailable_reason() -> str | None:
    """None when this process can build a fabric (root, ``ip``, ``tc`` and ``unshare`` on the
    PATH), else why not: a reason for ``pytest.mark.skipif``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [c for c in ("ip", "tc", "unshare") if shutil.which(c) is None]
    if missing:
        return f"needs iproute2 and util-linux: {', '.join(missing)} not found"
    return None


def _run(argv: Sequence[str], timeout: float = _CMD_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise FabricError(f"{' '.join(argv)}: no answer within {timeout:g} s") from exc
    if done.returncode != 0:
        raise FabricError(f"{' '.join(argv)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


class Fabric:
    """Hosts as network namespaces, each with one or more shaped NICs into per-NIC switches.

    Args:
        hosts: host name -> number of NICs (at least 1). Host names are letters, digits and
            ``_`` (they appear in namespace names and hostnames).
        rate_mbit: every link's rate in Mbit/s, each direction (``tbf`` on both veth ends).
        subnet: NIC ``i`` of every host is on ``10.<subnet>.<i + 1>.0/24``.
        mtu: every veth's MTU.
        burst_bytes: the token bucket's depth (default: 1 ms at the rate, at least 64 KiB, so
            that a veth's 64 KiB GSO packets pass whole instead of being re-segmented).
        latency_ms: the most a packet may queue in a shaper before it is dropped.
        prefix: the start of every namespace name (``ip netns list`` shows whose they are).

    Raises:
        ValueError: no hosts, a host without NICs, a bad host name, a rate not above 0.
    """

    def __init__(self, hosts: Mapping[str, int], *, rate_mbit: float = 1000.0, subnet: int = DEFAULT_SUBNET,
                 mtu: int = 1500, burst_bytes: int | None = None, latency_ms: float = 20.0,
                 prefix: str = "tfab") -> None:
        if not hosts:
            raise ValueError("a fabric needs at least one host")
        for h, n in hosts.items():
            if not h or not h.replace("_", "").isalnum() or not h.isascii():
                raise ValueError(f"host names are letters, digits and _, not {h!r}")
            if n < 1:
                raise ValueError(f"host {h!r} needs at least one NIC, not {n}")
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, not {rate_mbit!r}")
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet must be in 0..255, not {subnet}")
        self.hosts: dict[str, int] = dict(hosts)
        self.rate_mbit = float(rate_mbit)
        self.subnet = subnet
        self.mtu = mtu
        self.burst_bytes = burst_bytes or max(64 << 10, int(self.rate_mbit * 1e6 / 8 / 1000))
        self.latency_ms = latency_ms
        self.tag = uuid.uuid4().hex[:6]
        self.prefix = prefix
        self.switch_ns = f"{prefix}-sw-{self.tag}"
        self._made: list[str] = []  # namespaces created, in order
        self._procs: list[subprocess.Popen] = []

    # ---- names and addresses ---------------------------------------------------------------

    def ns(self, host: str) -> str:
        """The network namespace of ``host``."""
        self._check(host)
        return f"{self.prefix}-{host}-{self.tag}"

    def hostname(self, host: str) -> str:
        """The hostname processes on ``host`` see (unique to this fabric)."""
        self._check(host)
        return f"{host}-{self.tag}"

    def dev(self, host: str, nic: int) -> str:
        """The interface name of NIC ``nic`` inside ``host``'s namespace."""
        self._check(host, nic)
        return f"eth{nic}"

    def addr(self, host: str, nic: int = 0) -> str:
        """The IPv4 address of NIC ``nic`` of ``host``."""
        self._check(host, nic)
        return f"10.{self.subnet}.{nic + 1}.{list(self.hosts).index(host) + 1}"

    def addrs(self, host: str) -> list[str]:
        """Every NIC's address of ``host``, NIC 0 first."""
        return [self.addr(host, i) for i in range(self.hosts[host])]

    def _check(self, host: str, nic: int = 0) -> None:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in this fabric (hosts: {', '.join(self.hosts)})")
        if not 0 <= nic < self.hosts[host]:
            raise IndexError(f"host {host!r} has NICs 0..{self.hosts[host] - 1}, not {nic}")

    # ---- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> Fabric:
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def create(self) -> None:
        """Builds the namespaces, bridges, veth pairs, addresses and shapers.

        Raises:
            FabricUnavailableError: :func:`unavailable_reason`, or the first ``ip netns add``
                failed (namespaces cannot be made here); nothing is left behind.
            FabricError: a later step failed; everything made so far is removed first.
        """
        why = unavailable_reason()
        if why is not None:
            raise FabricUnavailableError(why)
        try:
            self._add_ns(self.switch_ns)
        except FabricError as exc:
            self.cleanup()
            raise FabricUnavailableError(f"cannot create network namespaces here: {exc}") from exc
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch_ns
        for nic in range(max(self.hosts.values())):
            _run(["ip", "-n", sw, "link", "add", f"br{nic}", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", f"br{nic}", "up"])
        for k, (host, nics) in enumerate(self.hosts.items()):
            ns = self.ns(host)
            self._add_ns(ns)
            for nic in range(nics):
                port, dev = f"h{k}n{nic}", self.dev(host, nic)
                _run(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name", dev,
                      "mtu", str(self.mtu), "netns", ns])
                _run(["ip", "-n", sw, "link", "set", port, "master", f"br{nic}"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr(host, nic)}/24", "dev", dev])
                self._shape(sw, port)
                self._shape(ns, dev)
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])

    def _shape(self, ns: str, dev: str) -> None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes), "latency", f"{self.latency_ms:g}ms"])

    def cleanup(self) -> None:
        """Kills and reaps the processes :meth:`popen` started that still run, then deletes every
        namespace this fabric made. Idempotent; never raises for a namespace already gone."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do here
                pass
        self._procs.clear()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_CMD_TIMEOUT_S)
        self._made.clear()

    # ---- processes and links -----------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on ``host``: in its namespace, with its hostname.
        The process that runs is ``argv[0]`` itself (every wrapper execs)."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(host), *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` (see :meth:`command`); :meth:`cleanup` kills it if it still
        runs then. ``kwargs`` go to :class:`subprocess.Popen` (stdout, stderr, cwd, text, ...)."""
        p = subprocess.Popen(self.command(host, argv), env=None if env is None else dict(env), **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], *, timeout: float = _CMD_TIMEOUT_S) -> str:
        """Runs ``argv`` in ``host``'s namespace (no hostname of its own: for ``ip``, ``tc``,
        ``ss``) and returns its stdout.

        Raises:
            FabricError: it exited with an error or ran past ``timeout``.
        """
        return _run(["ip", "netns", "exec", self.ns(host), *argv], timeout=timeout)

    def link(self, host: str, nic: int, up: bool) -> None:
        """Takes NIC ``nic`` of ``host`` down (a cut cable: packets are dropped, the subnet's route
        goes away on that host) or up again.

        Raises:
            FabricError: ``ip link set`` failed.
        """
        _run(["ip", "-n", self.ns(host), "link", "set", self.dev(host, nic), "up" if up else "down"])
