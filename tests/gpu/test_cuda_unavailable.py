"""CUDA without a driver (this machine): every entry point says why, with the typed error.

The GPU paths themselves are tested in tests/gpu/test_cuda.py (skipped here, run by
scripts/gpu_check.sh on a GPU machine).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import subprocess
import sys

import pytest
import torch

import transport
from tests._support import python_env
from transport import _cuda, _cuda_copier, _staging
from transport._native import cuda as native_cuda
from transport._native import load
from transport._peers import PEER_PREFIX
from transport._wire import PeerRecord, RegionRecord

pytestmark = pytest.mark.skipif(
    _cuda.unavailable_reason() is None, reason="a CUDA driver is present: these test its absence"
)

# Arguments of the right types for each native cuda_* function (the driver is never reached).
_NATIVE_ARGS = {
    "cuda_driver_version": (),
    "cuda_device_count": (),
    "cuda_device_uuid": (0,),
    "cuda_device_name": (0,),
    "cuda_allocation": (1 << 20,),
    "cuda_ipc_export": (1 << 20, 0),
    "cuda_ipc_open": (b"\0" * 64, 0),
    "cuda_ipc_close": (1 << 20, 0),
    "cuda_stream_create": (0,),
    "cuda_stream_destroy": (1, 0),
    "cuda_stream_synchronize": (1, 0),
    "cuda_host_register": (1 << 20, 4096, False, 0),
    "cuda_host_unregister": (1 << 20, 0),
    "cuda_module_load": (b"\0" * 16, 0),
    "cuda_module_function": (1, "f", 0),
    "cuda_launch": (1, (1, 1, 1), (1, 1, 1), 0, 0, b"", 0),
}


def test_reason_names_the_missing_driver():
    why = _cuda.unavailable_reason()
    assert why is not None and "libcuda.so.1" in why and "driver" in why


def test_every_native_cuda_call_raises_unavailable():
    c = load()
    names = sorted(n for n in dir(c) if n.startswith("cuda_") and n != "cuda_load")
    assert names == sorted(_NATIVE_ARGS), "a cuda_* binding was added or removed: list its arguments above"
    for name in names:
        with pytest.raises(c.CudaUnavailable, match=r"libcuda\.so\.1"):
            getattr(c, name)(*_NATIVE_ARGS[name])


def test_every_typed_driver_call_raises_backend_unavailable():
    """transport._native.cuda: one typed function per cuda_* binding, the same failure mapped
    into the error tree."""
    for name, args in _NATIVE_ARGS.items():
        fn = getattr(native_cuda, name.removeprefix("cuda_"))
        with pytest.raises(transport.BackendUnavailableError, match=r"libcuda\.so\.1"):
            fn(*args)
    with pytest.raises(transport.BackendUnavailableError, match=r"libcuda\.so\.1"):
        native_cuda.require_driver()
    assert native_cuda.unavailable_reason() == _cuda.unavailable_reason()


@pytest.mark.parametrize(
    "call",
    [
        lambda: _cuda.driver_version(),
        lambda: _cuda.device_count(),
        lambda: _cuda.device_uuid(0),
        lambda: _cuda.device_name(0),
        lambda: _cuda.device_label(0),
        lambda: _cuda.local_index("cuda:GPU-00000000-0000-0000-0000-000000000000"),
        lambda: _cuda.allocation(1 << 20),
        lambda: _cuda.ipc_export(_cuda.Allocation(1 << 20, 4096, 0, True)),
        lambda: _cuda.kernels(0),
        lambda: _cuda.stream_create(0),
        lambda: _cuda.stream_destroy(1, 0),
        lambda: _cuda.stream_synchronize(1, 0),
        lambda: _cuda_copier.CudaCopier(),
        lambda: _cuda.PinnedBuffer(4096, 0),
    ],
    ids=["driver_version", "device_count", "device_uuid", "device_name", "device_label", "local_index", "allocation",
         "ipc_export", "kernels", "stream_create", "stream_destroy", "stream_synchronize", "CudaCopier",
         "PinnedBuffer"],
)
def test_every_python_cuda_entry_point_raises_backend_unavailable(call):
    with pytest.raises(transport.BackendUnavailableError, match=r"libcuda\.so\.1"):
        call()


def test_public_functions_of_the_cuda_module_are_all_covered():
    public = {n for n, v in vars(_cuda).items()
              if callable(v) and not inspect.isclass(v) and not n.startswith("_")
              and getattr(v, "__module__", "") == _cuda.__name__}
    # unavailable_reason answers instead of raising; ready_event and current_stream need a CUDA
    # tensor or torch's CUDA to exist; driver_call runs the calls the others make.
    assert public == {"unavailable_reason", "ready_event", "current_stream", "driver_call", "driver_version",
                      "device_count", "device_uuid", "device_name", "device_label", "local_index", "allocation",
                      "ipc_export", "kernels", "stream_create", "stream_destroy", "stream_synchronize"}


@pytest.mark.parametrize(
    ("library", "expect"),
    [("/nonexistent/libcuda.so.1", "cannot load /nonexistent/libcuda.so.1"), ("libz.so.1", "lacks cuInit")],
)
def test_driver_override_that_is_not_a_driver(library, expect):
    """$TRANSPORT_CUDA_LIB: a missing file and a library that is not the driver are both refused
    with the reason (the load happens once per process, hence a subprocess)."""
    env = python_env() | {"TRANSPORT_CUDA_LIB": library}
    code = "from transport import _cuda; print(_cuda.unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout


def test_region_device_travels_in_the_peer_record_and_defaults_to_cpu():
    host = transport._wire.HostId("h", "boot", 1)
    regions = {
        "w": RegionRecord("w", "bfloat16", (4,), 8, True, {"ipc": b"x"}, device="cuda:GPU-1234"),
        "b": RegionRecord("b", "float32", (2,), 8, False, {}),
    }
    rec = PeerRecord("p", "inc", 1, 2, 3, host, ("127.0.0.1", 9), {"ipc": b""}, regions)
    data = rec.encode()
    assert b'"device":"cuda:GPU-1234"' in data and data.count(b'"device"') == 1  # host regions omit it
    back = PeerRecord.decode(data)
    assert back.regions["w"].device == "cuda:GPU-1234" and back.regions["b"].device == "cpu"


async def test_cpu_only_initiator_cannot_reach_a_peers_gpu_region(memory_store):
    """A peer on a GPU machine publishes a device region; this CPU-only process asking to put
    into it gets BackendUnavailableError with every backend's reason, and nothing moves."""
    async with transport.Transport("gpu-peer", store=memory_store, backends=("ipc", "tcp"), timeout=10) as peer:
        host = torch.zeros(16, dtype=torch.float32)
        peer.register("w", host)
        # What the same peer publishes when "w" is a CUDA tensor: the device region record.
        region = peer.regions["w"]
        key = PEER_PREFIX + "gpu-peer"
        record = PeerRecord.decode(peer._auth.open_record(peer._store.get(key), "gpu-peer"))
        gpu = dataclasses.replace(record.regions["w"], device="cuda:GPU-0badc0de-0000-0000-0000-000000000000",
                                  descriptors={"ipc": b"\0" * 88})
        peer._store.set(key, peer._auth.sign_record(dataclasses.replace(record, regions={"w": gpu}).encode()))
        async with transport.Transport("cpu", store=memory_store, backends=("ipc", "tcp"), timeout=10) as me:
            with pytest.raises(transport.BackendUnavailableError) as info:
                await me.put(torch.ones(16), "gpu-peer", key="w")
            msg = str(info.value)
            assert "ipc: no CUDA driver" in msg and "tcp: 'w' is device memory" in msg
        assert torch.equal(region.tensor, torch.zeros(16))


def test_staging_pieces_cover_the_bytes_in_whole_elements():
    chunk = _staging.STAGING_CHUNK
    assert _staging.staging_pieces(0, 4) == []
    assert _staging.staging_pieces(10, 2) == [(0, 10)]
    assert _staging.staging_pieces(2 * chunk + 6, 2) == [(0, chunk), (chunk, chunk), (2 * chunk, 6)]
    granule = 12  # an element size that does not divide the chunk
    pieces = _staging.staging_pieces(3 * chunk, granule)
    assert all(size % granule == 0 for _, size in pieces[:-1]) and sum(size for _, size in pieces) == 3 * chunk
    assert all(a + s == b for (a, s), (b, _) in itertools.pairwise(pieces))


def test_overlapping_destinations_never_go_to_the_batched_copy_kernel():
    # Its blocks run in no order; the ordered list of copies keeps "the later range wins".
    from transport._cuda_copier import _disjoint

    assert _disjoint([(0, 100, 4), (4, 200, 4), (64, 300, 0), (8, 400, 8)])
    assert not _disjoint([(0, 100, 5), (4, 200, 4)])
    assert not _disjoint([(8, 100, 4), (0, 200, 10)])  # found whatever the order of the list
    assert _disjoint([(6, 100, 0), (0, 200, 10)])  # an empty range writes nothing


def test_a_copy_is_polled_inline_only_while_it_is_short():
    """spin_for: the enqueueing thread (the event loop's) polls a device copy for about its
    expected time, never longer than SPIN_MAX_S, and not at all once it is expected to take
    longer than that (the engine's reaper then reports it)."""
    spin_for, most = _cuda_copier.spin_for, _cuda_copier.SPIN_MAX_S
    assert 0 < spin_for(1 << 20, host=False) < spin_for(64 << 20, host=False) <= most
    assert _cuda_copier.spin_for(1 << 30, host=False) == 0  # ~1 ms even on an H200: the reaper's
    assert _cuda_copier.spin_for(64 << 20, host=True) == 0  # host memory is ~30x slower
    assert 0 < _cuda_copier.spin_for(1 << 20, host=True) <= _cuda_copier.SPIN_MAX_S
    assert _cuda_copier.spin_for(0, host=False) == _cuda_copier.SPIN_BASE_S  # a kernel launch, or waits only
