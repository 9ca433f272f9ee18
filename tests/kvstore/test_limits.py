from __future__ import annotations

import pytest

from kvstore.address import Address
from kvstore.errors import InvalidRequestError
from kvstore.limits import MAX_KEY_BYTES, encode_key, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("4096", 4096),
        ("1.5KiB", 1536),
        ("2GB", 2 * 10**9),
        (" 8 mib ", 8 << 20),
        (7, 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1MiB", "4XB", "MiB", "1e9", None, -5, "1.2.3GiB"])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(InvalidRequestError):
        parse_size(text)  # type: ignore[arg-type]


def test_keys() -> None:
    assert encode_key("é") == "é".encode()
    assert encode_key(b"\x00") == b"\x00"
    assert len(encode_key("k" * MAX_KEY_BYTES)) == MAX_KEY_BYTES
    for bad in ("", b"", "k" * (MAX_KEY_BYTES + 1), 5, None):
        with pytest.raises(InvalidRequestError):
            encode_key(bad)  # type: ignore[arg-type]


def test_address() -> None:
    assert Address.parse("127.0.0.1:80") == Address("127.0.0.1", 80)
    assert Address.parse("[::1]:80") == Address("::1", 80)
    for bad in ("host", "h:x", "h:70000"):
        with pytest.raises(InvalidRequestError):
            Address.parse(bad)
