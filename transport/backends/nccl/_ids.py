"""Who a communicator is: its comm id, the GPUs it names, and its NCCL unique id in the store.

The comm id names both peers, their incarnations, both GPUs (by UUID, as this process's
:mod:`transport._cuda` identifies them) and a generation. The initiator makes an
``ncclUniqueId``, publishes it in the rendezvous store under ``nccl/<comm id>`` (signed with the
shared token when one is set) and deletes it once both ends are up; the target reads it.
"""

from __future__ import annotations

import re
from typing import Any

import anyio

from ... import _cuda
from ..._auth import Authenticator
from ..._errors import AuthenticationError, TransportInternalError
from ..._native.nccl import UNIQUE_ID_BYTES
from ..._rendezvous import Store

STORE_PREFIX = "nccl/"


def normalize_uuid(label: str) -> str:
    """A GPU UUID as bare lowercase hex, from "cuda:GPU-xxxxxxxx-...", "GPU-..." or torch's form."""
    s = label.strip().lower()
    s = s.removeprefix("cuda:").removeprefix("gpu-")
    return re.sub(r"[^0-9a-f]", "", s)


def local_uuid(device: int) -> str:
    """The bare-hex UUID of this process's CUDA device ``device``.

    Raises:
        BackendUnavailableError: no usable CUDA driver.
    """
    return normalize_uuid(_cuda.device_label(device))


def local_device(label: str) -> int | None:
    """This process's ordinal of the GPU a peer published as ``label`` ("cuda:<uuid>"), or None
    when this process does not see it (also when it sees no GPU at all)."""
    if _cuda.unavailable_reason() is not None:
        return None
    return _cuda.local_index(label)


def comm_id(initiator: str, initiator_inc: str, target: str, target_inc: str, local: str, remote: str, gen: int) -> str:
    """Names one communicator: both peers, their incarnations, both GPUs (bare-hex UUIDs), a generation."""
    return f"{initiator}.{initiator_inc}>{target}.{target_inc}/{local[:12]}>{remote[:12]}/{gen}"


async def store_call(store: Store, fn: Any, *args: Any) -> Any:
    """Calls a store method, on a worker thread when the store blocks."""
    return await anyio.to_thread.run_sync(fn, *args) if store.blocking else fn(*args)


async def publish_unique_id(store: Store, auth: Authenticator, cid: str, uid: bytes) -> str:
    """Publishes the NCCL unique id of communicator ``cid`` (signed when a token is set); returns
    the store key. Only the initiator of ``cid`` ever publishes it."""
    key = STORE_PREFIX + cid
    await store_call(store, store.set, key, auth.sign_record(uid, key=key))
    return key


async def read_unique_id(store: Store, auth: Authenticator, cid: str, initiator: str) -> bytes:
    """The unique id ``initiator`` published for ``cid``.

    Raises:
        TransportInternalError: none is published, it is not signed with our token, or it is
            not a unique id.
    """
    data = await store.aget(STORE_PREFIX + cid)
    if data is None:
        raise TransportInternalError(f"no NCCL unique id for comm {cid} under {STORE_PREFIX + cid!r} in {store.url}")
    try:
        uid = auth.open_record(data, initiator, key=STORE_PREFIX + cid)
    except AuthenticationError as exc:
        raise TransportInternalError(f"the NCCL unique id of comm {cid}: {exc}") from exc
    if len(uid) != UNIQUE_ID_BYTES:
        raise TransportInternalError(f"the NCCL unique id of comm {cid} has {len(uid)} bytes, not {UNIQUE_ID_BYTES}")
    return uid
