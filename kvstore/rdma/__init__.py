"""EXPERIMENTAL: the RDMA transport (one-sided READ/WRITE between client buffers and node arenas).

Status. This code has never run on a real RDMA device: the machines it was written on have no
InfiniBand/RoCE NIC (no ``/sys/class/infiniband``). Treat it as unproven until
``pytest -m rdma`` has passed on your hardware. What *is* tested:

* everywhere: discovery reporting "none" and the one fallback line, the ``KVSTORE_RDMA*``
  settings, the memory-region table, the wire forms and their exchange through the master, the
  node's queue-pair bookkeeping and its typed refusal of ``rdma_connect`` without a device, the
  client's fallback to TCP, and the client and node halves driven end to end over a software
  loopback fabric of the tests' own (``tests/client/test_rdma.py``: grants kept, commits checked,
  queue-pair bound and teardown, errors, threads);
* where the kernel has a software device (``rdma_rxe``) and pyverbs is installed: the verbs
  wrapper itself (register, connect a queue pair, one-sided READ and WRITE; tests marked
  ``rdma``, skipped elsewhere).

Not tested: a real NIC, RoCE GID selection, devices' limits (message size, outstanding reads),
performance.

Shape, and why. The package sits in the core layer, so it holds what the node and the client
share; the node's half lives in the node's layer:

* :mod:`kvstore.rdma.devices`: pyverbs loading, device discovery, :class:`RdmaConfig` from the
  environment, and the fallback line ``"<role>: RDMA off (<why>); using TCP"``;
* :mod:`kvstore.rdma.wire`: what the peers exchange (:class:`RdmaOffer`, :class:`QpEndpoint`);
* :mod:`kvstore.rdma.ibverbs`: the verbs wrapper (memory regions, :class:`VerbsContext`,
  :class:`RcQueuePair`, :class:`RdmaOp`);
* :mod:`kvstore.node.rdma` (``node/rdma.py``): the node's side (queue pairs per client connection, the
  ``rdma_connect`` / ``rdma_commit`` verbs, the offer to publish).

The client's side stays in the client layer, as :mod:`kvstore.client.rdma`: it is a client
transport built on the client's connection pool and item types (``kvstore.client.transport``),
and the core must not import the client. It imports this package, never the reverse.
The classes and functions below are re-exported so that callers write ``rdma.RdmaConfig``
whichever module holds them (of the constants only ``TEST_DEVICE_ENV``, a name: patch the
others where they live);
:mod:`kvstore.node.rdma` is not imported here (the client has no use for it).

How it fits together (Mooncake's transfer engine does the same with its metadata service):

1. A node that finds a device opens it, registers each DRAM arena once as a memory region
   (``ibv_reg_mr`` with LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE) and publishes an
   :class:`RdmaOffer` (device, port, GID, LID, and per segment the region's address, length and
   rkey) through the master (``register`` → ``transports``).
2. A client that also has a device reads the offer (``node_transports``), creates an RC queue
   pair and sends its :class:`QpEndpoint` to the node over a TCP connection it keeps for that
   purpose (node verb ``rdma_connect``); the node creates a queue pair for that connection, moves
   it to RTS and answers with its own endpoint. The node tears the queue pair down when that TCP
   connection closes, and serves a bounded number of them.
3. Reads and writes are then one-sided RDMA READ/WRITE at ``region.addr + grant.offset``. The
   node's CPU is not involved, so the *client* keeps to the ranges the master granted (segment,
   offset, size, operation, expiry). A write is still committed by the node (``rdma_commit``:
   grant and checksum checked, exactly like ``shm_commit``) before the client calls ``put_end``;
   a read is checked against the object's checksum by the client, as over TCP.

Trust: the rkey is the capability. Any process that holds a node's offer and can reach its device
can read and write the node's whole arena, grant or not: the same trust as the shm transport
(one cluster, one operator), and the same reason the cluster token guards ``node_transports``.

Where either side has no device, pyverbs is missing, or anything on the RDMA path fails, the
node and the client each log one line saying so and use TCP. Settings come from the environment
(:class:`RdmaConfig`): ``KVSTORE_RDMA=off`` disables RDMA, ``KVSTORE_RDMA_DEVICE`` picks a
device, ``KVSTORE_RDMA_PORT`` and ``KVSTORE_RDMA_GID_INDEX`` (RoCE v2: usually 1 or 3).
"""

from kvstore.rdma.devices import (
    TEST_DEVICE_ENV,
    RdmaConfig,
    RdmaDevice,
    discover,
    first_device,
    import_pyverbs,
    log_fallback,
    log_once,
)
from kvstore.rdma.ibverbs import (
    MemoryRegion,
    MemoryRegionTable,
    RcQueuePair,
    RdmaOp,
    VerbsContext,
    address_of,
    gid_text,
)
from kvstore.rdma.wire import QpEndpoint, RdmaOffer, choose

__all__ = [
    "TEST_DEVICE_ENV",
    "MemoryRegion",
    "MemoryRegionTable",
    "QpEndpoint",
    "RcQueuePair",
    "RdmaDevice",
    "RdmaOffer",
    "RdmaOp",
    "RdmaConfig",
    "VerbsContext",
    "address_of",
    "choose",
    "discover",
    "first_device",
    "gid_text",
    "import_pyverbs",
    "log_fallback",
    "log_once",
]
