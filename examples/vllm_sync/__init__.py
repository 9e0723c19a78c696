"""A trainer pushing weights into real vLLM engines with ``transport.vllm`` (see run.py)."""
