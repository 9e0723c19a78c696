# Type stubs of the native extension transport._C (csrc/module.cpp). The extension is installed as
# transport._C; code in transport/_native reaches it as `_C` (see _extension.py), typed by this file.
# Keep it in step with csrc/module.cpp: every binding there has its signature here.
#
# Failures: a native failure arrives as RuntimeError (ValueError / IndexError for bad arguments);
# the cuda_* functions raise CudaUnavailable without a usable driver and CudaError when the driver
# refuses a call. Addresses, handles, streams, events, modules and functions are plain integers.

from collections.abc import Sequence

# -- copy engine and host memory -----------------------------------------------------------------

class CopyPlan:
    """A job's segments cut at the engine's chunk size and grouped into units, once (immutable)."""

    @property
    def kind(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def segments(self) -> int: ...
    @property
    def units(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class CopyEngine:
    """Copies (dst, src, nbytes) segments on its threads; completions through an eventfd."""

    def __init__(self, threads: int, chunk_bytes: int) -> None: ...
    @property
    def event_fd(self) -> int: ...
    def submit(self, kind: int, pid: int, segments: Sequence[tuple[int, int, int]]) -> int:
        """Queues a job of CopyKind `kind`; returns its id. Raises ValueError for an unknown kind."""
    def submit_packed(self, kind: int, pid: int, packed: bytes) -> int:
        """As submit, with the segments packed as little-endian u64 (dst, src, nbytes) triples."""
    def plan_packed(self, kind: int, pid: int, packed: bytes) -> CopyPlan:
        """Packed segments cut and grouped for this engine, once. Raises ValueError."""
    def submit_plan(self, plan: CopyPlan) -> int:
        """Queues a job over `plan` (which may be submitted again, also while running); returns its id."""
    @property
    def threads(self) -> int: ...
    def cancel(self, arg: int, /) -> bool: ...
    def drain(self) -> list[tuple[int, int, int, int]]:
        """(job id, CopyStatus, errno, bytes copied) of every job finished since the last drain."""
    def shutdown(self) -> None: ...

class SharedBuffer:
    """A page-aligned memfd mapping that same-host peers can map through /proc/<pid>/fd."""

    def __init__(self, nbytes: int, name: str, read_only: bool = False) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def fd(self) -> int: ...
    @property
    def inode(self) -> int: ...
    @property
    def sealed(self) -> bool: ...
    def seal_writes(self) -> int:
        """Seals the memfd against new writable mappings and writes (F_SEAL_FUTURE_WRITE); returns 0 or errno."""
    def read_only_address(self) -> int:
        """The address of a PROT_READ mapping of the same memfd (made on first call). Raises RuntimeError."""
    def array(self) -> object:
        """A 1-D uint8 DLPack capsule over the buffer that keeps it alive (torch.from_dlpack)."""

class PeerMapping:
    """This process's mapping of another process's memfd `fd` (through /proc/<pid>/fd/<fd>)."""

    def __init__(self, pid: int, fd: int, nbytes: int, writable: bool, inode: int = 0) -> None:
        """Raises RuntimeError; also when `inode` (0: unchecked) is not the inode of the file found."""
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def populate(self, packed: bytes, column: int, write: bool) -> int:
        """Fills the page tables for the pages of packed (dst, src, nbytes) rows' `column` side; 0 or errno."""

def copy_plan_now(plan: CopyPlan) -> tuple[int, int]:
    """Copies a plan's segments on the calling thread; returns (errno or 0, bytes copied)."""

def copy_packed_now(kind: int, pid: int, packed: bytes) -> tuple[int, int]:
    """Copies packed (dst, src, nbytes) segments on the calling thread; returns (errno or 0, bytes copied)."""

def copy_now(kind: int, pid: int, dst: int, src: int, nbytes: int) -> int:
    """Copies on the calling thread; returns 0 or errno. For small copies only."""

def memory_fence() -> None:
    """A full memory fence: orders a flag store before the next load of another process's flag."""

def cma_probe(pid: int, address: int, nbytes: int) -> int:
    """0 if `nbytes` at `address` of process `pid` can be read by cross-memory attach, else errno."""

def probe_address() -> int:
    """The address of a readable byte in this process (what peers' cma_probe reads)."""

def allow_ptrace_from_any() -> int:
    """prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); returns 0 or errno."""

def stream_copy(dst: int, src: int, nbytes: int) -> None:
    """Copies with streaming (non-temporal) stores and a store fence; for large copies not read back soon."""

def memcpy(dst: int, src: int, nbytes: int) -> None:
    """Plain single-threaded memcpy: the same-run baseline of the benchmarks."""

# -- ucx (UcxEngine, ucx_load and ucx_status_string exist only when ucx_compiled is True) ---------

ucx_compiled: bool

def ucx_load(path: str) -> tuple[str, str]:
    """Loads libucp with dlopen (once per process); returns (loaded path, version). Raises RuntimeError."""

def ucx_status_string(status: int) -> str: ...

class UcxEngine:
    """One UCP context and its lanes (a worker and a progress thread each)."""

    def __init__(self, library: str, name: str, lanes: int, chunk_bytes: int, window: int) -> None: ...
    @property
    def event_fd(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    def worker_address(self, lane: int) -> bytes: ...
    def mem_map(self, address: int, nbytes: int, remote_write: bool = True,
                local_write: bool = True) -> tuple[int, bytes]:
        """(memory handle, packed rkey) of a ucp_mem_map of the range; without remote_write (or
        local_write) its protection lacks UCP_MEM_MAP_PROT_REMOTE_WRITE (LOCAL_WRITE)."""
    def mem_unmap(self, mem: int) -> None: ...
    def ep_create(self, lane: int, address: bytes) -> int: ...
    def ep_close(self, lane: int, ep: int, force: bool) -> None: ...
    def rkey_unpack(self, lane: int, ep: int, packed: bytes) -> int: ...
    def rkey_destroy(self, lane: int, rkey: int) -> None: ...
    def submit(self, lane: int, op: int, ep: int, rkey: int, local: int, remote: int, nbytes: int) -> int:
        """Queues a put (op 0) or get (op 1) on `lane`; returns its job id (unique across lanes)."""
    def cancel(self, lane: int, job: int) -> None: ...
    def submit_many(self, lane: int, op: int, ep: int, rkey: int, packed: bytes) -> int:
        """Queues many ranges of one region as one job (one completion, one flush); returns its id."""
    def transfer_now(self, lane: int, op: int, ep: int, rkey: int, local: int, remote: int, nbytes: int,
                     timeout_us: int) -> tuple[int, int]:
        """Moves bytes synchronously on the lane's thread; returns (ucs status, bytes moved) once the job ended."""
    def transfer_now_pair(self, op: int, first: tuple[int, int, int, int, int, int],
                          second: tuple[int, int, int, int, int, int], timeout_us: int) -> tuple[int, int]:
        """Two parts (lane, ep, rkey, local, remote, nbytes) at once, the second by the engine's assistant thread."""
    def read_word(self, lane: int, ep: int, rkey: int, remote: int, timeout_ms: int) -> tuple[int, int]:
        """Reads an 8-byte remote word synchronously (bounded); returns (ucs status, value)."""
    def drain(self) -> list[tuple[int, int, int, int]]:
        """(job id, CopyStatus, ucs status, bytes) of every job finished since the last drain."""
    def shutdown(self) -> None: ...

# -- cuda: the driver (loaded at run time) and the operations built on it ------------------------

class CudaUnavailable(RuntimeError):
    """No usable CUDA driver; the message says why."""

class CudaError(RuntimeError):
    """The driver refused a call; the message names the call and the driver's error."""

def cuda_load(path: str = "") -> str:
    """Loads the CUDA driver once; returns '' when usable, else why not (later calls repeat the first outcome)."""

def cuda_driver_version() -> int: ...
def cuda_device_count() -> int: ...
def cuda_device_uuid(device: int) -> str: ...
def cuda_device_name(device: int) -> str: ...
def cuda_allocation(ptr: int, device: int = -1) -> tuple[int, int, int, bool]:
    """(base, size, device, legacy_ipc_capable) of the device allocation holding ptr."""

def cuda_ipc_export(base: int, device: int) -> bytes: ...
def cuda_ipc_open(handle: bytes, device: int) -> int: ...
def cuda_ipc_close(ptr: int, device: int) -> None: ...
def cuda_stream_create(device: int) -> int: ...
def cuda_stream_destroy(stream: int, device: int) -> None: ...
def cuda_stream_synchronize(stream: int, device: int) -> None: ...
def cuda_host_register(ptr: int, nbytes: int, read_only: bool, device: int) -> None: ...
def cuda_host_unregister(ptr: int, device: int) -> None: ...
def cuda_module_load(image: bytes, device: int) -> int: ...
def cuda_module_function(module: int, name: str, device: int) -> int: ...
def cuda_launch(
    function: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_bytes: int,
    stream: int,
    params: bytes,
    device: int,
) -> None: ...
class CudaEngine:
    """Device copies enqueued on the calling thread; their ends polled inline or reaped by a
    native thread and announced on `event_fd` (csrc/cuda_engine.h)."""

    def __init__(self) -> None: ...
    @property
    def event_fd(self) -> int: ...
    def order(self, device: int, stream: int, after: list[tuple[int, int]], events: list[int]) -> None:
        """`stream` waits for the work queued so far on the `after` (device, stream) pairs and for `events`."""
    def submit(
        self, id: int, device: int, stream: int, after: list[tuple[int, int]], events: list[int], packed: bytes,
        spin_ns: int,
    ) -> tuple[int, int, int, str] | None:
        """Enqueues job `id` and polls it for spin_ns: (id, status, code, message) when it ended by then, else None."""
    def drain(self) -> list[tuple[int, int, int, str]]:
        """(id, status, code, message) of every ended, unclaimed job since the last call."""
    def inflight(self) -> int: ...
    def shutdown(self) -> None: ...

def kernels_image() -> bytes | None:
    """The fatbin of csrc/kernels (None when the build had no nvcc)."""

def kernels_arches() -> str:
    """The GPU architectures the kernels were built for, comma-separated ('' without kernels)."""

# -- tcp: the direct lane (csrc/tcp_direct.cpp) --------------------------------------------------

class RegionMirror:
    """The host regions one endpoint registered, as the direct lane's native threads see them."""

    def __init__(self) -> None: ...
    def set(self, key: str, address: int, nbytes: int, itemsize: int, writable: bool, dtype: str) -> None: ...
    def remove(self, key: str, token: int) -> bool:
        """True when a request still moves the region's bytes (`token` then comes back from released())."""
    def mark_moved(self, key: str) -> None: ...
    def released(self) -> list[int]: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...

class DirectServer:
    def __init__(self, mirror: RegionMirror, owner: str, io_timeout_s: float, max_conns: int) -> None: ...
    def adopt(self, fd: int) -> bool:
        """Takes ownership of a connected socket; False: it was closed (shut down, or at max_conns)."""
    @property
    def connections(self) -> int: ...
    @property
    def served(self) -> int: ...
    def close(self) -> None: ...

class DirectLane:
    def __init__(self, fd: int) -> None: ...
    def start(self, op: int, key: str, dtype: str, offset: int, nbytes: int, local: int, wait_s: float) -> int:
        """0 done, 1 pending, 2 refused, 3 broken (csrc/tcp_direct.h DirectLane::Result). Raises ValueError."""
    def finish(self, wait_s: float) -> int: ...
    @property
    def pending(self) -> bool: ...
    @property
    def writing(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def fd(self) -> int: ...
    @property
    def message(self) -> str: ...
    def close(self) -> None: ...
