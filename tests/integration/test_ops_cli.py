"""``kvstore status|nodes|evict`` against a live cluster, settings from a TOML file, flags and
environment; the admin API over TLS with a self-signed certificate."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvstore.client import Client
from tests.support import Cluster, start_master

SECRET = "ops-cli-test-token-0123456789abcdef"


def kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, "HOME": "/nonexistent", **(env or {})},
    )


@pytest.fixture
def secured(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    c = Cluster(
        tmp_path,
        start_master("--token-file", str(token_file)),
        node_args=("--token-file", str(token_file)),
    )
    try:
        c.add_node("32MiB")
        yield c, token_file
    finally:
        c.stop()


def test_status_nodes_evict(secured, tmp_path: Path) -> None:
    cluster, token_file = secured
    with Client.connect(cluster.address, token=SECRET) as c:
        c.batch_put([f"cli/{i}" for i in range(4)], [b"abc"] * 4)
    config = tmp_path / "config.toml"
    config.write_text(f'admin = "{cluster.admin}"\ntoken_file = "{token_file}"\n')

    out = kvstore("status", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert "objects   4" in out.stdout
    assert "TIER" in out.stdout and "dram" in out.stdout

    out = kvstore("nodes", env={"KVSTORE_CONFIG": str(config)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "ADDRESS", "STATE"]
    assert len(lines) == 3 and "active" in lines[2]

    # Reads are public; evicting needs the token: without it nothing changes.
    out = kvstore("evict", "--admin", cluster.admin, "--prefix", "cli/")
    assert out.returncode == 2 and "bearer token" in out.stderr
    assert SECRET not in out.stderr + out.stdout
    out = kvstore(
        "evict", "--admin", cluster.admin, "cli/0", "cli/9", env={"KVSTORE_TOKEN": SECRET}
    )
    assert out.returncode == 0, out.stderr
    assert "evicted 1 object(s); 1 not found" in out.stdout
    # The flag beats the config file: a wrong admin URL on the command line is used (and fails).
    out = kvstore(
        "status", "--config", str(config), "--admin", "http://127.0.0.1:9", "--timeout", "2"
    )
    assert out.returncode == 2 and "unreachable" in out.stderr
    out = kvstore("evict", "--config", str(config), "--prefix", "cli/", "--json")
    assert out.returncode == 0 and '"num_evicted": 3' in out.stdout


def test_bad_settings_are_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 'blue'\n")
    out = kvstore("status", "--config", str(bad))
    assert out.returncode == 2 and "unknown key 'colour'" in out.stderr
    out = kvstore("evict", "--admin", "http://127.0.0.1:9")
    assert out.returncode == 2 and "exactly one" in out.stderr


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_admin_over_tls(tmp_path: Path) -> None:
    import ssl

    cert, key = _self_signed(tmp_path)
    master = start_master("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        admin = master.field("admin")
        assert admin.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{admin}/health", timeout=10, context=ctx) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.URLError):  # not trusted without the CA
            urllib.request.urlopen(f"{admin}/health", timeout=10)
        out = kvstore("status", "--admin", admin, "--ca-file", str(cert))
        assert out.returncode == 0, out.stderr
        assert "nodes     0" in out.stdout
    finally:
        master.stop()


def test_tls_flags_go_together(tmp_path: Path) -> None:
    out = kvstore("master", "--port", "0", "--admin-port", "0", "--tls-cert", str(tmp_path / "c"))
    assert out.returncode == 2 and "go together" in out.stderr


def test_node_rest_over_tls(tmp_path: Path) -> None:
    import ssl

    from tests.support import Daemon

    cert, key = _self_signed(tmp_path)
    master = start_master()
    try:
        node = Daemon(
            [
                "node",
                "--master",
                master.field("control"),
                "--port",
                "0",
                "--admin-port",
                "0",
                "--dram",
                "16MiB",
                "--data-dir",
                str(tmp_path / "n"),
                "--tls-cert",
                str(cert),
                "--tls-key",
                str(key),
            ],
            ready=r"kvstore node ready",
        )
        try:
            admin = node.field("admin")
            assert admin.startswith("https://")
            ctx = ssl.create_default_context(cafile=str(cert))
            with urllib.request.urlopen(f"{admin}/health", timeout=10, context=ctx) as r:
                assert r.status == 200
            with pytest.raises(urllib.error.URLError):  # not trusted without the CA
                urllib.request.urlopen(f"{admin}/health", timeout=10)
        finally:
            node.stop()
    finally:
        master.stop()


def test_up_serves_its_node_rest_over_tls_too(tmp_path: Path) -> None:
    """``kvstore up --tls-cert --tls-key``: the master's admin API and its node's REST both."""
    import ssl

    from tests.support import Daemon

    cert, key = _self_signed(tmp_path)
    up = Daemon(
        ["up", "--port", "0", "--dram", "16MiB", "--data-dir", str(tmp_path / "d")]
        + ["--tls-cert", str(cert), "--tls-key", str(key)],
        ready=r"kvstore up: ready",
    )
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        for admin in (up.field("admin"), up.field("node_admin")):
            assert admin.startswith("https://"), admin
            with urllib.request.urlopen(f"{admin}/health", timeout=10, context=ctx) as r:
                assert r.status == 200
    finally:
        up.stop()
