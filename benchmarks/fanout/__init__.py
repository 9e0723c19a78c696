"""``python -m benchmarks.fanout``: one trainer's version to generators on other hosts, over
shaped links between network namespaces: direct pushes, per-host relays, relays striped over
two NICs, and gloo broadcast, against the floor of one copy per host across the trainer's link.

    python -m benchmarks.fanout                                  # every method (root; ~10 min)
    python -m benchmarks.fanout --methods direct,gloo,floor      # a subset
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
* ``floor``: computed: 2 copies across T's link at the shaped rate, and at the measured stream;
* ``stop`` / ``kill``: ``relays`` with host A's relay ``SIGSTOP``ped / ``SIGKILL``ed
  ``--fault-after`` of the relays' median into the version, the publisher's deadline (what a
  failed relay may cost its host, by the library's rule) ``--fault-deadline``: when each
  subscriber was live, and the publish report's result for each.

It prints the table with ratios against the floor and against direct, and whether each of the
issue's targets holds (a method that failed is reported, and the exit code is 1). Needs root.
The harness is :mod:`._run`; :mod:`._roles` are the processes, :mod:`._report` the figures.
"""
