"""The client SDK: ``from kvstore.client import Client, KVCache, Namespace``."""

from kvstore.client.buffers import Segments
from kvstore.client.client import Client
from kvstore.client.kvcache import KVCache
from kvstore.keys import Namespace

__all__ = ["Client", "KVCache", "Namespace", "Segments"]
