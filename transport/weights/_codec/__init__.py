"""The delta codec: how a version travels as the changes since a base, with no I/O of its own.

Each module imports only those listed before it (and ``transport._native.delta``, which only this
package imports among the weights modules):

    format    both wire forms, versioned by their magics (stream: STREAM_MAGIC; mesh: MESH_MAGIC),
              the index and table layouts, checksum words
    checksum  the per-tensor checksum and the passes computing it (SumPass)
    patch     the one checked, all-or-nothing apply of sparse deltas (apply_patches), for both
              forms: the stream's tensors and a mesh generator's slot
    policy    the crossover of both forms: where a delta stops paying, per subscriber or generator
              rank, from what the publisher measured
    parts     the runs of a stream version as the diff hands them to the pushes, a part at a time
              (Source, Parts)
    encode    the stream form's encoder (DeltaEncoder, DeltaVersion) and its thresholds
    apply     the stream form's apply (DeltaApplier): the live tensors' checksums, the header's
              checks, its patches (through patch) and dense tensors
    runs      the mesh form: a trainer rank's changes cut along generator ranks' byte runs, and
              their materialisation in a generator's slot (through patch)

Its drivers are the stream publisher and subscriber, the mesh publisher and subscriber (and,
through them, the vLLM worker); they move the bytes, the codec only makes and checks them.
"""
