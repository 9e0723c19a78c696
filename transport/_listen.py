"""Where an agent listens: the addresses a Transport's ``listen=`` (or ``$TRANSPORT_LISTEN``)
names, one per NIC, parsed and checked at the call; the default when it names none; and the
listening sockets (:class:`~transport._agent.AgentServer` serves them)."""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Sequence

from ._wire import MAX_AGENT_ADDRESSES


def parse_listen(listen: str | Sequence[str] | None) -> list[tuple[str, int]] | None:
    """The addresses ``listen`` names (None: none given): a comma-separated str or a sequence of
    str, each item ``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a bare IPv6 address (port 0: any).

    Raises:
        ValueError: an empty item, a port that is not an integer in 0..65535, an address named
            twice, or more than MAX_AGENT_ADDRESSES addresses.
        TypeError: ``listen`` is neither a str nor a sequence of str.
    """
    if listen is None or listen == "":
        return None
    if isinstance(listen, str):
        items = listen.split(",")
    elif isinstance(listen, Sequence) and all(isinstance(i, str) for i in listen):
        items = list(listen)
    else:
        raise TypeError(f"listen is a str or a sequence of str, got {type(listen).__name__}")
    out: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if item.startswith("["):
            host, sep, port = item[1:].partition("]")
            if not sep or (port and not port.startswith(":")):
                raise ValueError(f"listen address {raw!r}: expected [V6] or [V6]:PORT")
            port = port[1:]
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:
            host, port = item, ""
        if not host:
            raise ValueError(f"listen address {raw!r} names no host (listen={listen!r})")
        if not (port or "0").isdigit() or not 0 <= int(port or 0) < 65536:
            raise ValueError(f"listen address {raw!r}: the port must be an integer in 0..65535")
        address = (host, int(port or 0))
        if address in out:
            raise ValueError(f"listen names {raw.strip()!r} twice")
        out.append(address)
    if len(out) > MAX_AGENT_ADDRESSES:
        raise ValueError(f"listen names {len(out)} addresses, at most {MAX_AGENT_ADDRESSES}")
    return out


def listen_addresses(listen: Sequence[tuple[str, int]] | None, store_url: str) -> list[tuple[str, int]]:
    """Where an agent listens: the addresses ``listen`` names (see :func:`parse_listen`) if
    any, else the local address that reaches a ``tcp://`` store (any port), else 127.0.0.1."""
    if listen:
        return list(listen)
    parsed = urllib.parse.urlparse(store_url)
    if parsed.scheme == "tcp" and parsed.hostname:
        return [(local_address_towards(parsed.hostname, parsed.port or 1), 0)]
    return [("127.0.0.1", 0)]


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port``. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def local_address_towards(host: str, port: int) -> str:
    """The local IP this host would use to reach ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
