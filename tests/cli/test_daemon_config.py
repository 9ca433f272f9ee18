"""``--config FILE`` of ``kvstore up|master|node|router``: every flag from TOML, the command
line wins, an unknown key or a wrong kind is one line naming the key and the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import build_parser, daemon_config, main
from kvstore.env import Env


def parse(argv: list[str]):
    parser = build_parser(Env())
    command = daemon_config.apply(parser, argv)
    args = parser.parse_args(argv)
    if command is not None:
        daemon_config.fill_lists(args)
    return args


@pytest.fixture
def cfg(tmp_path: Path):
    def write(text: str) -> str:
        path = tmp_path / "kvstore.toml"
        path.write_text(text)
        return str(path)

    return write


def test_every_flag_of_up_comes_from_the_file_and_the_command_line_wins(cfg) -> None:
    path = cfg(
        'port = 7800\nadmin-port = 7900\ndram = "64MiB"\ndata_dir = "/tmp/x"\nshm = true\n'
        'public_reads = false\nhigh_watermark = 0.5\neviction_policy = "lfu"\nframe_timeout = 3\n'
    )
    args = parse(["up", "--config", path, "--port", "7000"])
    assert args.port == 7000  # the command line wins
    assert (args.admin_port, args.dram, args.data_dir) == (7900, "64MiB", "/tmp/x")
    assert args.shm is True and args.public_reads is False
    assert (args.high_watermark, args.eviction_policy, args.frame_timeout) == (0.5, "lfu", 3.0)


def test_a_command_table_applies_to_that_command_only(cfg) -> None:
    path = cfg(
        'token_file = "/etc/tok"\n[master]\nport = 7710\n'
        '[node]\nmaster = "10.0.0.1:7710"\ndata_dir = "/var/kv"\n'
    )
    node = parse(["node", "--config", path])  # --master and --data-dir are required flags
    assert (node.master, node.data_dir, node.token_file) == ("10.0.0.1:7710", "/var/kv", "/etc/tok")
    master = parse(["--log-level", "debug", "master", f"--config={path}"])
    assert (master.port, master.token_file) == (7710, "/etc/tok")


def test_a_list_flag_takes_the_file_unless_the_command_line_gives_it(cfg) -> None:
    path = cfg('prefill = ["http://p1", "http://p2"]\nmax_body = "1MiB"\npolicy = "round-robin"\n')
    args = parse(["router", "--config", path])
    assert args.prefill == ["http://p1", "http://p2"] and args.max_body == 1 << 20
    assert parse(["router", "--config", path, "--prefill", "http://p9"]).prefill == ["http://p9"]


def test_a_value_outside_the_choices_is_refused(cfg, capsys: pytest.CaptureFixture[str]) -> None:
    path = cfg('policy = "fifo"\n')
    assert main(["router", "--config", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvstore router: config {path!r}: 'policy' must be one of cache-aware, round-robin, "
        "least-loaded, not 'fifo'"
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            'dramm = "1GiB"',
            "unknown key 'dramm': kvstore up has no --dramm flag (did you mean 'dram'?)",
        ),
        ("parent_pipe = 3", "unknown key 'parent_pipe': kvstore up has no --parent-pipe flag"),
        ('port = "7700"', "'port' must be a number (int), not '7700'"),
        ("shm = 1", "'shm' must be true or false, not 1"),
        ("[up]\nhost = 3", "'host' must be a string"),
        ("port = ", "is not valid TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key_and_the_file(
    cfg, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cfg(text)
    assert main(["up", "--config", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvstore up: config {path!r}"), err
    assert said in err[0], err


def test_the_operator_commands_keep_their_own_config(cfg) -> None:
    """``kvstore get up --config F``: a key named up, and the operator file, not a daemon's."""
    path = cfg('master = "10.0.0.1:7700"\n')
    args = parse(["get", "up", "--config", path])
    assert args.key == "up" and args.config == path


def test_kvstore_up_runs_from_a_config_file(cfg, tmp_path: Path) -> None:
    path = cfg(f'port = 0\ndram = "32MiB"\ndata_dir = "{tmp_path / "data"}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--log-level", "warning", "up", "--config", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # bounded: the process ends or prints its ready line
            lines.append(line)
            if "kvstore up: ready" in line:
                break
        assert any("dram=32.0 MiB" in x and str(tmp_path / "data") in x for x in lines), lines
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
