"""``python -m benchmarks.fanout``: one trainer's version to generators on other hosts, over
shaped links between network namespaces: direct pushes, per-host relays, relays striped over
two NICs, gloo broadcast, and mesh sync without and with per-host relays, against the floor of
one copy per host across the trainer's link.

    python -m benchmarks.fanout                                  # every method (root; ~12 min)
    python -m benchmarks.fanout --methods direct,gloo,floor      # a subset
    python -m benchmarks.fanout --methods floor,mesh-direct,mesh-relays --warmup 2
    python -m benchmarks.fanout --size 8MB --reps 1 --methods direct,floor --json out.json
    python -m benchmarks.fanout --record benchmarks/results --label LABEL

Hosts are network namespaces (:mod:`tests._support.netns`): T with the trainer, A and B with
three generator processes each (``gen-a0`` .. ``gen-b2``; ``gen-a0`` is host A's relay by the
library's rule, the first subscriber of a host by name). Every host has two NICs, each a veth
into a switch bridge of its own; every link is shaped with ``tbf`` to ``--rate-mbit`` (default
1000) each way. Why 1 Gbit/s: unshaped, a veth between two namespaces carries a plain TCP stream
an order of magnitude faster even on a 2-core machine, so at 1 Gbit/s (two links: 2) the links,
not the CPUs, bound every method (check it in a record: ``direct`` takes about six copies' time
at the measured stream rate, and T's NIC counters show the copies), and a 200 MB version still
takes seconds, far above the timers' noise. The run measures, before the methods, a plain socket
stream of the state's size over one shaped link (and over two at once for ``striped``): the
goodput the links really carry. Each method also reports what every host NIC carried.

Methods, each in fresh processes, ``--warmup`` untimed versions then ``--reps`` timed ones,
the time of a version being from the publish's start until the last generator's
``wait_version`` returned (``time.time()`` in each process; one machine, one clock):

* ``direct``: ``Publisher(t, state, relays=False)`` / ``Subscriber(..., relay=False)`` (where
  the library has the switch; before it, pushes are direct anyway): T pushes every copy;
* ``relays``: ``relays=True`` / ``relay=True``: T pushes one copy per host, its relay forwards;
* ``striped``: ``relays`` with every Transport listening on both NICs (``listen="A0,A1"``);
* ``gloo``: ``torch.distributed`` gloo, 7 ranks, T rank 0, bucketed ``broadcast`` (``--bucket-mib``);
* ``mesh-direct`` / ``mesh-relays``: mesh sync of the same state, ``MeshPublisher(delta=False,
  relays=False / True)`` and ``MeshSubscriber(relay=...)``: two trainer ranks on T, each holding
  half of every tensor (``Shard(0)``), and a tp=1 replica per generator process (each needs the
  whole state: from each trainer rank the same bytes, which relays push once per host). The time
  of a version runs from the first trainer rank's publish start until the last replica had it
  committed and applied (its leader tries ``commit()`` once both ranks signalled that their
  ``publish()`` returned, and every ``--mesh-poll-ms`` besides); when both publishes returned is
  reported too, and every version applied is checked against the trainer's digest
  (:mod:`._mesh_roles`);
* ``floor``: computed: 2 copies across T's link at the shaped rate, and at the measured stream;
* ``stop`` / ``kill``: ``relays`` with host A's relay ``SIGSTOP``ped / ``SIGKILL``ed
  ``--fault-after`` of the relays' median into the version, the publisher's deadline (what a
  failed relay may cost its host, by the library's rule) ``--fault-deadline``: when each
  subscriber was live, and the publish report's result for each.

It prints the table with ratios against the floor and against direct (the mesh rows: against
mesh-direct), and whether each of the issue's targets holds (a method that failed, or a mesh
version applied with the wrong digest, is reported, and the exit code is 1). Needs root. The
harness is :mod:`._run`; :mod:`._roles` and :mod:`._mesh_roles` are the processes,
:mod:`._report` the figures.
"""
