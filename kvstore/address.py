"""``host:port`` addresses, as every daemon, flag and client names a peer."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def parse(text: str, *, default_host: str = "127.0.0.1") -> Address:
        """Parse ``host:port`` (or ``:port``).

        Raises:
            InvalidRequestError: when it is not ``host:port`` with a port in 0..65535.
        """
        if not isinstance(text, str) or ":" not in text:
            raise InvalidRequestError(f"address must look like HOST:PORT, got {text!r}")
        host, _, port_text = text.rpartition(":")
        host = host.strip("[]") or default_host
        try:
            port = int(port_text)
        except ValueError:
            raise InvalidRequestError(f"bad port in address {text!r}") from None
        if not 0 <= port <= 65535:
            raise InvalidRequestError(f"port out of range in {text!r}")
        return Address(host, port)
