"""The storage node: holds objects' bytes in its tiers and serves them to clients by grant.

What each module owns, from the wire inwards:

* ``server``: the data server's sockets, one thread per connection and its frame loop (whose
  rules, shared with the master, are ``kvstore.serving``'s), the verb registry
  (``DataServer.register_verb``) and the grant checks the verbs share;
* ``verbs``: the verbs every node serves (``write``, ``read``, ``ping``, ``manifest``,
  ``stats``); ``shm_verbs`` and the RDMA verbs add theirs where those transports are on;
* ``manifest``: what the node holds whole, to claim to a new master (its records are the core
  ``kvstore.stored_object.StoredObject``, the same the tiers store);
* ``tiers``: the tier interface; ``arena`` (DRAM, the one tier writes land in in place),
  ``nvme`` and ``hbm`` implement it;
* ``agent`` and ``follow``: the link to the master (register, heartbeat, follow the leader);
  ``tasks``: the moves and copies the master hands out in heartbeat replies;
* ``admin``: the node's small REST endpoint; ``daemon``: the node process that wires it all.

The node imports the core ``kvstore`` layer only, never the master or the client.
"""
