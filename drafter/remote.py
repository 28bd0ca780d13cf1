"""The remote draft source: the datastore service's gRPC client already implements ``SourceDrafter``.

``RemoteDrafter("127.0.0.1:50051")`` returns the same trees as ``LocalDrafter.open(index)`` on the
same index (and, from ``draft_sources``, the same output-store trees once both were given the same
outputs); ``RemoteDrafter(address, tls_ca="ca.pem", auth_token=...)`` reaches a server started
with ``--tls-cert``/``--auth-token``. See ``datastore.client.DatastoreClient`` for timeouts and errors.
"""

from rest_spec.datastore.client import DatastoreClient as RemoteDrafter

__all__ = ["RemoteDrafter"]
