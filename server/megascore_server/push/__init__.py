"""``UpdateWeights`` on the server: a client stream of named tensors, staged on every rank,
swapped at once.

:mod:`.chunks` checks and reassembles the stream's tensors (:class:`PushSession`, in the
host buffers :class:`TensorBuffers` reuses); :mod:`.pusher` runs one push at a time
against the batcher's engine: staging, the commit barrier, two phases and deltas
(:class:`WeightPusher`).
"""
