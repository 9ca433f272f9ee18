"""The node's side of the shm transport: committing bytes a same-host client wrote in place.

A client on this host that maps the arena (see ``kvstore.client.shm``) copies an object's bytes
straight into the granted range, then sends ``shm_commit`` here over TCP (no payload): the node
checks the write grant, checks that the range still belongs to that grant's allocation
(``kvstore.node.claims.WriteClaims``: a newer allocation's claim refuses it, and a commit uses the grant up),
checksums the bytes in its arena and records them in its manifest. Only then does the client
commit the put at the master (``put_end``). So a write through shared memory is granted,
checksummed and committed exactly like one over TCP.

``shm_commit``  ``{"items": [[grant, checksum], ...]}`` → per item ``[code, None | message]``
(a grant one-key or a reference to a batch grant given earlier in the items: ``kvstore.grants``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import xxhash

from kvstore import grants, protocol
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    ProtocolError,
)
from kvstore.stored_object import StoredObject
from kvstore.types import result_to_wire

if TYPE_CHECKING:
    from kvstore.node.server import DataServer, VerbHandler


def make_shm_commit(server: DataServer, via: str = "shm") -> VerbHandler:
    """The ``shm_commit`` handler for ``server``, to register with ``server.register_verb``
    (only where shm is enabled).

    Also serves as ``rdma_commit`` (``via="RDMA"``): bytes written in place, by whatever means,
    are committed the same way.
    """

    def shm_commit(
        fs: protocol.FramedSocket, req: protocol.Request, payload_len: int, scratch: memoryview
    ) -> None:
        if payload_len:
            raise ProtocolError(f"{req.verb} takes no payload")
        items = req.args.get("items")
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 for i in items
        ):
            raise InvalidRequestError(f"{req.verb} takes items: [[grant, checksum], ...]")
        results: list[Any] = []
        reader = server.grant_reader(grants.OP_WRITE)
        owned = server.owned_by(fs)  # a tenant's connection commits its own keys only
        for grant_wire, checksum in items:
            try:
                grant, view = server.granted_view(
                    grant_wire, grants.OP_WRITE, reader=reader, owned=owned
                )
                if not isinstance(checksum, int) or isinstance(checksum, bool):
                    raise InvalidRequestError("checksum must be an integer")
                # The range must still belong to this grant's allocation (and any older write
                # still streaming into it stops first): see kvstore.node.claims.WriteClaims.
                claim = server.claims.begin(grant, None)
                ok = xxhash.xxh3_64_intdigest(view) == checksum
                server.claims.end(claim, None, complete=ok)
                if not ok:
                    raise ChecksumMismatchError(
                        f"bytes written through {via} do not match checksum"
                    )
                server.manifest.record(StoredObject.written(grant, checksum))
                results.append([0, None])
            except KVStoreError as err:
                results.append(result_to_wire(err))
        server.num_writes += len(items)
        fs.send_frame(protocol.encode_response(req.req_id, results))

    return shm_commit
