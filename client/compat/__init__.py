"""Drop-in replacements for other stores' client APIs, running on kvstore.

- ``kvstore.client.compat.mooncake``: Mooncake Store's ``MooncakeDistributedStore`` (0.3.x).

This package itself imports nothing.
"""
