"""The client SDK: ``from kvstore.client import Client``."""

from kvstore.client.client import Client

__all__ = ["Client"]
