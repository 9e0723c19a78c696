"""Weight sync: a ``Publisher`` on the trainer, a ``Subscriber`` on each generator.

After every optimizer step the trainer calls ``await publisher.publish(version)``; every
subscribed generator receives the whole state dict **independently and concurrently**, and
applies it between its own generation steps with ``await subscriber.apply_async()`` (the copy
runs in a worker thread; ``subscriber.apply()`` does it on the calling thread). Nothing is
collective: generators subscribe and leave at any time (through the rendezvous), a slow
generator is reported as a straggler after ``deadline`` seconds and never delays the others, a
generator that died or left since the last publish is reported once (``failed`` / ``left``), and
a generator that joins late (or restarts) catches up with ``await subscriber.pull()``.

How a version travels, and why it is never torn:

* The publisher packs the state dict (after ``rename``/``include``/``fp8`` hooks) into one of
  two **snapshot** buffers, guarded by a per-slot generation counter (a seqlock), and publishes
  the layout (names, shapes, dtypes, byte offsets, buckets) as a read-only region.
* Each subscriber registers two **slots** of the packed size and a small control block. The
  publisher writes a version into the slot the subscriber is *not* about to read, as one
  prepared transfer of all its buckets (made when the subscriber is first served, reused every
  version), and only when every byte is in the subscriber's memory does it write the slot's
  number and the version into the control block (the *front*) and ring a doorbell signal.
* ``apply()`` (and ``apply_async()``, on a worker thread) announces which slot it is reading in
  the control block, re-checks the front (the classic two-flag handshake, with memory barriers
  on both sides), and copies that slot into the model. The publisher never writes the slot a
  subscriber has announced; if the subscriber is still reading it, the publisher waits (at most
  until the deadline).
* ``pull()`` reads the publisher's current snapshot one-sidedly and keeps it only if the slot's
  generation counter did not move during the read.

Memory: the publisher holds two packed copies of the (converted) weights, each subscriber two
packed slots; nothing else grows with the model or the number of subscribers.

Delta sync (``delta=True``, the default for host state): a version that changed little goes to
a subscriber holding exactly the previous one as the changed elements only (their new values,
or for 2-byte elements their steps from the values they replace), checked against per-tensor
checksums before anything is written and applied inside the same slot handshake (``_codec``;
README, "Delta sync").

Modules: ``_layout`` (the packed layout), ``_control`` (region names, control blocks, front
words, the CPU memory barrier, the slot claim), ``_lifecycle`` (start/aclose), ``_warm`` (one
``warm()`` for both publishers), ``_report`` (what a publish reports).
The stream publisher: ``_publisher`` (``Publisher``: the publish as a sequence of phases) over
``_roster`` (whom it serves, who left or died), ``_pipeline`` (``VersionPipeline``: sample or
pack, diff, complete the snapshot, the background passes; the one writer of the snapshots),
``_snapshots`` (its two packed snapshots that ``pull`` reads, and their background fill),
``_push`` (one version into one subscriber), ``_delta_feed`` (a delta version's parts as the
diff hands them out), ``_doorbells`` and ``_relays`` (per-host relays: a host's subscribers get a
version through one of them).
The stream subscriber: ``_subscriber`` (``Subscriber``) over ``_trust`` (the publisher's word on
the versions it is offered, and the live version), ``_target`` (the local tensors a version is
written into), ``_delta_intake`` (its delta versions), ``_apply`` (how a slot becomes the
local weights) and ``_relay_member`` (its part in relays; the control words in ``_relay_block``).
Mesh sync: ``_mesh_publisher`` (``MeshPublisher``), ``_mesh_subscriber`` (``MeshSubscriber``;
its replica and plan ``_mesh_replica``, the leader's commit ``_mesh_commit``, its delta areas
``_mesh_delta_intake``), ``_mesh_control`` (its regions and control words), ``_binding`` (the
plan's moves bound to byte offsets of the snapshots and slots), ``_mesh_peers`` (who takes
part), ``_mesh_fp8`` (FP8 block scales made at the source).
Both: ``_codec`` (the delta codec, no I/O: both wire forms, checksums, the encoder, the one
checked apply of sparse patches, the crossover policy, the mesh form's runs), ``_copy`` (host
copies split across the cores), ``_polling`` (the one poll loop and the one seqlock read every
wait on a peer's control words goes through). Every class here is an async context manager and
has ``aclose()``.
Packing and device unpacking use the batched gather/scatter of ``transport._tensor_kernels``.
"""

from .._errors import CommitError as CommitError
from .._errors import DeltaRefusedError as DeltaRefusedError
from .._errors import LayoutMismatchError as LayoutMismatchError
from .._public import rehome
from ._codec.encode import delta_isa as delta_isa
from ._mesh_peers import read_trainer_layout as read_trainer_layout
from ._mesh_publisher import MeshPublisher as MeshPublisher
from ._mesh_publisher import MeshPublishReport as MeshPublishReport
from ._mesh_subscriber import MeshSubscriber as MeshSubscriber
from ._publisher import Publisher as Publisher
from ._report import DeltaStats as DeltaStats
from ._report import PublishReport as PublishReport
from ._report import SyncResult as SyncResult
from ._report import SyncStatus as SyncStatus
from ._subscriber import Subscriber as Subscriber

__all__ = [
    "CommitError",
    "DeltaRefusedError",
    "DeltaStats",
    "LayoutMismatchError",
    "MeshPublishReport",
    "MeshPublisher",
    "MeshSubscriber",
    "PublishReport",
    "Publisher",
    "read_trainer_layout",
    "Subscriber",
    "SyncResult",
    "SyncStatus",
    "delta_isa",
]

rehome(globals(), __all__, __name__)
