"""Benchmarks of ``transport`` against the status quo: one package per benchmark, each run as
``python -m benchmarks.<name>``, and :mod:`benchmarks.common` for what two or more share.

They use only the public ``transport`` API (``tests/api/test_public_api_use.py`` checks it).

* ``p2p``: put/get bandwidth and small-transfer latency per backend between two processes, next to
  a same-run ``memcpy`` baseline; ``--peers nixl,mooncake`` adds those libraries, measured the same
  way in the same run. ``python -m transport bench`` is a thin entry to it.
* ``gpu_bench``: device put/get between two processes on one GPU, next to same-run torch copies.
* ``weight_sync``: one trainer process syncs a Llama-shaped bf16 state dict to K generator
  processes with ``transport.weights`` (per backend) and with ``torch.distributed`` (gloo)
  broadcast, per parameter and bucketed, with and without a straggling generator.
* ``mesh_sync``: mesh-to-mesh sync (trainer ranks -> inference replicas) against a
  ``full_tensor()`` gather + broadcast.
* ``delta_sync``: delta sync against dense, on real training updates.
* ``vllm_sync``: weight sync into a real vLLM engine against a gloo broadcast + ``load_weights``.

Inside a benchmark's package, ``_run`` is the harness and the other underscored modules are its
own parts (its target process, its report, its peers). Recorded runs are in ``benchmarks/results/``.
"""
