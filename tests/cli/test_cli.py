"""The ``kvstore`` command line: help for every flag, the version, and what ``up`` passes on."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import build_parser, main, version
from kvstore.cli.common import wire_deadlines
from kvstore.cli.daemons import master_options, node_argv
from kvstore.env import Env
from kvstore.errors import InvalidRequestError
from kvstore.master.daemon import MasterDaemonConfig
from kvstore.node.daemon import NodeDaemonConfig
from kvstore.serving import WireDeadlines


def _parsers(parser: argparse.ArgumentParser, path: str = "kvstore"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_flag_has_help() -> None:
    missing = [
        f"{path} {action.option_strings or action.dest}"
        for path, parser in _parsers(build_parser(Env()))
        for action in parser._actions
        if action.help is not argparse.SUPPRESS
        and not isinstance(action, argparse._SubParsersAction)
        and not (action.help or "").strip()
    ]
    assert not missing, missing


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["node", "--help"], ["--host", "(default: 127.0.0.1)", "(default: 512MiB)"]),
        (["up", "--help"], ["--dram", "(default: 512MiB)", "(default: port + 2)"]),
        (["master", "--help"], ["(default: 7700)", "(default: lru)", "(default: port + 1)"]),
        *(
            (
                [cmd, "--help"],
                [
                    "--frame-timeout SECONDS",
                    "is dropped (default: 10.0)",
                    "--hello-timeout SECONDS",
                    "(with a token) (default: 5.0)",
                ],
            )
            for cmd in ("master", "node", "up")
        ),
        (["--help"], ["--version", "(default: info)"]),
    ],
)
def test_help_shows_the_defaults(
    argv: list[str], shown: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for word in shown:
        assert word in text, word


def test_version_comes_from_the_package_metadata() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore {version()}"
    assert version() != "unknown"


def test_a_bad_environment_variable_is_one_clear_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVSTORE_CHUNK_ITEMS": "lots"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "kvstore: $KVSTORE_CHUNK_ITEMS='lots': expected an integer in 1..1073741824"
    ]


def test_up_passes_its_tls_and_security_flags_to_its_node(tmp_path: Path) -> None:
    args = build_parser(Env()).parse_args(
        [
            "up",
            "--tls-cert",
            "cert.pem",
            "--tls-key",
            "key.pem",
            "--token-file",
            "tok",
            "--no-public-reads",
            "--shm",
            "--dram",
            "64MiB",
        ]
    )
    argv = node_argv(args, "127.0.0.1:7700", 7702, tmp_path, 9)
    assert argv[argv.index("--tls-cert") + 1] == str(Path("cert.pem").resolve())
    assert argv[argv.index("--tls-key") + 1] == str(Path("key.pem").resolve())
    assert argv[argv.index("--token-file") + 1] == str(Path("tok").resolve())
    assert {"--no-public-reads", "--shm"} <= set(argv)
    assert argv[argv.index("--dram") + 1] == "64MiB"
    # and the node's own parser takes that command line
    node = build_parser(Env()).parse_args(argv[3:])
    assert node.tls_cert == str(Path("cert.pem").resolve()) and node.parent_pipe == 9


def test_the_wire_deadline_flags_reach_the_options_of_master_and_node(tmp_path: Path) -> None:
    flags = ["--frame-timeout", "2.5", "--hello-timeout", "0.75"]
    want = WireDeadlines(frame_s=2.5, hello_s=0.75)
    parser = build_parser(Env())
    assert master_options(parser.parse_args(["master", *flags]), 0, Env()).deadlines == want
    # `kvstore up`: its master takes them, and so does its node's command line
    up = parser.parse_args(["up", *flags])
    assert master_options(up, 0, Env()).deadlines == want
    node = parser.parse_args(node_argv(up, "127.0.0.1:7700", 0, tmp_path, 9)[3:])
    assert wire_deadlines(node) == want
    # the defaults are the protocol's
    assert wire_deadlines(parser.parse_args(["up"])) == WireDeadlines()


@pytest.mark.parametrize("cmd", ["master", "node", "up"])
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--frame-timeout", "0"),
        ("--frame-timeout", "-1"),
        ("--frame-timeout", "nan"),
        ("--hello-timeout", "0"),
        ("--hello-timeout", "-0.5"),
        ("--hello-timeout", "inf"),
    ],
)
def test_a_bad_wire_deadline_stops_the_command_with_one_line(
    cmd: str, flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything starts: no port is bound, no node is spawned."""
    needs = {
        "master": [],
        "node": ["--master", "127.0.0.1:1", "--data-dir", str(tmp_path)],
        "up": ["--data-dir", str(tmp_path)],
    }
    assert main([cmd, *needs[cmd], "--port", "0", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstore {cmd}: {flag} must be a finite number > 0, not {float(value)!r}"]
    assert not list(tmp_path.iterdir())  # the node never started: nothing written


def test_up_without_tls_gives_its_node_none(tmp_path: Path) -> None:
    args = build_parser(Env()).parse_args(["up"])
    assert "--tls-cert" not in node_argv(args, "127.0.0.1:7700", 0, tmp_path, 9)


@pytest.mark.parametrize(
    "bad", [{"port": -1}, {"admin_port": 70000}, {"host": ""}, {"chunk_items": 0}]
)
def test_master_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        MasterDaemonConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [{"dram_bytes": 0}, {"nvme_bytes": -1}, {"hbm_bytes": -1}, {"port": 65536}]
)
def test_node_options_are_validated(tmp_path: Path, bad: dict[str, object]) -> None:
    fields = {"host": "127.0.0.1", "port": 0, "dram_bytes": 1 << 20, "data_dir": tmp_path}
    with pytest.raises(InvalidRequestError):
        NodeDaemonConfig(**{**fields, **bad})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["up", "--port", "{p}"], "--port"),
        (["up", "--port", "0", "--admin-port", "{p}"], "--admin-port"),
        (["master", "--port", "{p}", "--admin-port", "0"], "--port"),
        (["node", "--master", "127.0.0.1:1", "--port", "{p}"], "--port"),
        (["node", "--master", "127.0.0.1:1", "--admin-port", "{p}"], "--admin-port"),
        (["up", "--port", "0", "--node-port", "{p}"], "kvstore up --node-port"),
    ],
)
def test_a_taken_port_is_one_line_naming_the_port_and_its_flag(
    argv: list[str], flag: str, tmp_path: Path
) -> None:
    """A second ``kvstore up`` (or master, or node) on a port another process holds."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = [a.format(p=port) for a in argv]
        if args[0] in ("up", "node"):
            args += ["--data-dir", str(tmp_path)]
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "--log-level", "warning", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    role = "node" if flag.startswith("kvstore up") else args[0]
    assert lines[0] == (
        f"kvstore {role}: port {port} on 127.0.0.1 is already in use (another kvstore may be "
        f"running): stop it, or choose another port with {flag} (0 picks a free one)"
    ), lines
    if role == args[0]:
        assert len(lines) == 1, lines
    else:  # `kvstore up` adds that its node failed, and nothing else
        assert len(lines) == 2 and lines[1].startswith("kvstore up: the storage node failed"), lines
