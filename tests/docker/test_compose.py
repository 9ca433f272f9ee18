"""docker/: the compose file's structure, the Prometheus scrape config and the Dockerfile.

Docker cannot run here; ``docker compose config`` runs only where the compose plugin exists.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (dev extra) not installed")

DOCKER = Path(__file__).resolve().parents[2] / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd if isinstance(cmd, list) else cmd.split()


def _flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def test_services(compose: dict) -> None:
    services = compose["services"]
    masters = [s for s in services.values() if _command(s)[0] == "master"] if services else []
    nodes = [s for s in services.values() if _command(s)[0] == "node"]
    assert "etcd" in services and "prometheus" in services
    assert len(masters) == 2 and len(nodes) == 2
    for s in [*masters, *nodes]:
        assert s["image"] == "kvstore:latest"
        assert s["build"]["dockerfile"] == "docker/Dockerfile"
        assert (DOCKER / s["build"]["context"] / s["build"]["dockerfile"]).exists()
        assert "kvstore_token" in s["secrets"]
        assert s["environment"]["KVSTORE_TOKEN_FILE"] == "/run/secrets/kvstore_token"
        assert s["depends_on"]["etcd"]["condition"] == "service_healthy"
        cmd = _command(s)
        # Bind to the service's own name, so the address it advertises resolves for the others.
        assert _flag(cmd, "--host") == s["hostname"] and s["hostname"] in services
        assert not any("token" in c and "file" not in c for c in cmd[1:]), "token on a command line"
    for m in masters:
        assert _flag(_command(m), "--etcd") == "etcd:2379"
    for n in nodes:
        cmd = _command(n)
        assert _flag(cmd, "--master") == "etcd://etcd:2379"
        assert n["shm_size"], "the DRAM arena needs /dev/shm room"
    assert compose["secrets"]["kvstore_token"]["file"] == "./secrets/kvstore_token"
    assert any("--advertise-client-urls=http://etcd:2379" in c for c in _command(services["etcd"]))


def test_ports_publish_on_loopback_only(compose: dict) -> None:
    for name, s in compose["services"].items():
        for port in s.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_prometheus_scrapes_every_daemon(compose: dict) -> None:
    prom = compose["services"]["prometheus"]
    mount = next(v for v in prom["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((DOCKER / mount.split(":")[0]).read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    expected = set()
    for name, s in compose["services"].items():
        cmd = _command(s) if "command" in s else []
        if cmd and cmd[0] in ("master", "node"):
            expected.add(f"{name}:{_flag(cmd, '--admin-port')}")
    assert targets == expected
    for job in config["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        assert job["authorization"]["credentials_file"] == "/run/secrets/kvstore_token"


def test_dockerfile_is_slim_and_not_root() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert froms and all(f.startswith("python:3.11-slim") for f in froms)
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["kvstore"]' in text
    assert "HEALTHCHECK" in text


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker compose plugin is not installed",
)
def test_docker_compose_config(tmp_path: Path) -> None:
    secrets = DOCKER / "secrets"
    made = not secrets.exists()
    secrets.mkdir(exist_ok=True)
    token = secrets / "kvstore_token"
    wrote = not token.exists()
    if wrote:
        token.write_text("0" * 64)
    try:
        out = subprocess.run(
            ["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    finally:
        if wrote:
            token.unlink()
        if made:
            secrets.rmdir()
