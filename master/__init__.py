"""The master: the control plane of the store (see ``service.py`` for its owners and layers)."""
