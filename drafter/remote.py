"""The remote draft source: the datastore service's gRPC client already implements ``Drafter``.

``RemoteDrafter("127.0.0.1:50051")`` returns the same trees as ``LocalDrafter.open(index)`` on the
same index; see ``datastore.client.DatastoreClient`` for timeouts and errors.
"""

from datastore.client import DatastoreClient as RemoteDrafter

__all__ = ["RemoteDrafter"]
