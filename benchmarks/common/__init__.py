"""What two or more benchmarks share.

* :mod:`.errors`: :class:`~.errors.BenchError`, the benchmarks' one error type;
* :mod:`.sizes`: the size syntax (``64MiB``, ``1GiB``) every benchmark's options use;
* :mod:`.stats`: medians and percentiles;
* :mod:`.procs`: helper processes with logged output, and groups of workers on one queue;
* :mod:`.capabilities`: which backends (and CUDA) ``transport`` can run here;
* :mod:`.machine`: the host, the measured checkout, the command line and the other load, for the record;
* :mod:`.batch`: the shape of the batch of small segments (10,000 x 4 KiB).
"""
