"""Benchmarks of ``transport`` against the status quo, run as ``python -m benchmarks.<name>``.

They use only the public ``transport`` API (``tests/test_benchmarks_public_api.py`` checks it).

* ``p2p``: put/get bandwidth and small-transfer latency per backend between two processes, next to
  a same-run ``memcpy`` baseline. ``python -m transport bench`` is a thin entry to it.
* ``gpu_bench``: device put/get between two processes on one GPU, next to same-run torch copies.
* ``weight_sync``: one trainer process syncs a Llama-shaped bf16 state dict to K generator
  processes with ``transport.weights`` (per backend) and with ``torch.distributed`` (gloo)
  broadcast, per parameter and bucketed, with and without a straggling generator.

Shared parts: ``_sizes`` (the size syntax), ``_stats`` (medians, percentiles), ``_procs``
(helper processes with logged output), ``_capabilities`` (what ``transport`` can run here),
``_errors`` (``BenchError``). Recorded runs are in ``benchmarks/results/``.
"""
