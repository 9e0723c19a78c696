"""``python -m benchmarks.weight_sync``: One trainer process syncs a Llama-shaped bf16 state dict to K
generator processes with ``transport.weights`` (per backend) and with ``torch.distributed`` (gloo)
broadcast, per parameter and bucketed, with and without a straggling generator.

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""
