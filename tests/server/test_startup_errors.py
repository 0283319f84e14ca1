"""Start-up mistakes as a user makes them, with the real command in its own process: each gets one
line on standard error naming the mistake, no traceback, and a non-zero exit status."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("KVROUTE_CONFIG", None)
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=60, env=env)


def one_line_error(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another process (here: this one) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_serve_on_a_port_in_use(taken_port: int) -> None:
    done = run("serve", "--worker", "http://127.0.0.1:9", "--port", str(taken_port))
    line = one_line_error(done, 1, f"cannot listen on 127.0.0.1:{taken_port}", "address already in use")
    assert line.startswith("kvroute serve: ")


def test_sim_on_a_port_in_use(taken_port: int) -> None:
    done = run("sim", "--port", str(taken_port))
    one_line_error(done, 1, "kvroute sim: cannot listen on", str(taken_port), "address already in use")


def test_sim_replicas_over_a_port_in_use(taken_port: int) -> None:
    done = run("sim", "--replicas", "2", "--port", str(taken_port - 1))
    one_line_error(done, 1, f"{taken_port - 1}-{taken_port}", "address already in use")


def test_unreadable_config_file(tmp_path: Path) -> None:
    done = run("serve", "--config", str(tmp_path / "missing.toml"), "--worker", "http://127.0.0.1:9")
    one_line_error(done, 2, "kvroute serve: cannot read config file", "No such file or directory")
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    one_line_error(run("serve", "--config", str(folder)), 2, "cannot read config file", "Is a directory")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00port = 1")
    one_line_error(run("serve", "--config", str(binary)), 2, "is not UTF-8 text")


def test_invalid_config_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("port = [\n")
    one_line_error(run("serve", "--config", str(broken)), 2, "is not valid TOML")
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('workers = ["http://127.0.0.1:9"]\nport = "eighty"\nretires = 2\n')
    one_line_error(run("serve", "--config", str(wrong)), 2, "unknown setting(s): retires")
    wrong.write_text('workers = ["http://127.0.0.1:9"]\nport = "eighty"\n')
    one_line_error(run("serve", "--config", str(wrong)), 2, "port must be an integer, got 'eighty'")


@pytest.mark.parametrize(("url", "says"), [
    ("10.0.0.1:8000", "worker url must start with http:// or https://"),
    ("http://:8000", "names no host"),
    ("http://gpu0:99999", "is not valid"),
    ("http://gpu0:port", "is not valid"),
    ("http://gpu0:8000/?x=1", "must not have a query"),
])
def test_bad_worker_url(url: str, says: str) -> None:
    one_line_error(run("serve", "--worker", url), 2, says)


def test_bad_log_options() -> None:
    one_line_error(run("serve", "--worker", "http://127.0.0.1:9", "--log-format", "xml"), 2,
                   "log_format must be text or json")
    one_line_error(run("serve", "--worker", "http://127.0.0.1:9", "--log-level", "loud"), 2,
                   "log level must be one of debug, info, warning, error")
    one_line_error(run("sim", "--log-format", "yaml"), 2, "log format must be text or json")


def test_unreadable_api_key_file(tmp_path: Path) -> None:
    done = run("serve", "--worker", "http://127.0.0.1:9", "--api-key-file", str(tmp_path / "keys"))
    one_line_error(done, 2, "cannot read api_key_file")
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    one_line_error(run("serve", "--worker", "http://127.0.0.1:9", "--api-key-file", str(empty)), 2,
                   "holds no key")


def test_otlp_endpoint_that_is_not_a_url() -> None:
    done = run("serve", "--worker", "http://127.0.0.1:9", "--otlp-endpoint", "collector:4318")
    one_line_error(done, 2, "otlp_endpoint must be an http:// or https:// URL")
