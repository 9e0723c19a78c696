"""``python -m benchmarks.mesh_sync``: Mesh-to-mesh weight sync (``MeshPublisher`` ->
``MeshSubscriber``) against the ``full_tensor()`` gather + gloo broadcast frameworks do today.

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""
