"""Weight pushes from the client: the request stream of a trainer's tensors (``requests``;
a tensor's bytes, ``tensors``; its messages, ``packing``), the clients' push methods
(``client_methods``), what ``push_weights`` does for both clients (``plan``), and
all-or-none pushes to a replica set (``replicas``)."""

__all__ = []
