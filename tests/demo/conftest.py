"""The demo's tests share the adapter tests' small pool."""

from tests.adapters.conftest import pool  # noqa: F401
