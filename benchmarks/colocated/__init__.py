"""``python -m benchmarks.colocated``: colocated weight sync, a trainer and K generator processes
sharing one GPU, ``transport.weights`` (copy and zero-copy apply) against the CUDA IPC handles of
vLLM's ``ipc`` weight transfer and a device ``copy_`` floor, in one run.

The harness is :mod:`._run`; the other underscored modules are its own parts: :mod:`._models`
(the models and what they need), :mod:`._roles` (what each process does), :mod:`._report` (the
results, JSON and Markdown).
"""
