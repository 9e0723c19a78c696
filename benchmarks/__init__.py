"""Benchmarks of ``transport`` against the status quo, run as ``python -m benchmarks.<name>``.

* ``weight_sync``: one trainer process syncs a Llama-shaped bf16 state dict to K generator
  processes with ``transport.weights`` (per backend) and with ``torch.distributed`` (gloo)
  broadcast, per parameter and bucketed, with and without a straggling generator.

The micro-benchmark of raw put/get bandwidth lives in the library (``python -m transport bench``).
Recorded runs are in ``benchmarks/results/``.
"""
