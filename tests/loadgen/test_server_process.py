"""How ``spawn_until_healthy`` starts an inference server: in the caller's session (one
scheduler autogroup with the load generator, see its comment) but a process group of its own,
which ``stop_server`` ends whole, the server's children included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokentrace.loadgen.local_vllm import free_loopback_port, spawn_until_healthy, stop_server

# A server that starts a child of its own (as vLLM starts its engine) and answers /health.
_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class _Failed(RuntimeError):
    pass


def _spawn(command: list[str], port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    return spawn_until_healthy(
        command,
        env=dict(os.environ),
        log_path=tmp_path / "server.log",
        health_url=f"http://127.0.0.1:{port}/health",
        ready_timeout_s=30.0,
        name="test server",
        error=_Failed,
    )


def _gone(pid: int, *, within_s: float) -> bool:
    """The process ended (a zombie not yet reaped by whoever adopted it counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_server_shares_the_callers_session_in_its_own_group_that_stop_ends_whole(
    tmp_path: Path,
) -> None:
    port = free_loopback_port()
    child_pid_file = tmp_path / "child.pid"
    process = _spawn(
        [sys.executable, "-c", _SERVER, str(port), str(child_pid_file)], port, tmp_path
    )
    child = int(child_pid_file.read_text())
    try:
        assert os.getsid(process.pid) == os.getsid(0)
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        assert os.getpgid(child) == process.pid
    finally:
        stop_server(process, timeout_s=5.0)
    assert process.poll() is not None
    assert _gone(child, within_s=10.0), "the server's child outlived stop_server"


def test_a_server_that_exits_before_it_is_healthy_is_an_error_with_its_log(
    tmp_path: Path,
) -> None:
    with pytest.raises(_Failed, match=r"test server exited with 3 .*\n.*no model here"):
        _spawn(
            [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
            free_loopback_port(),
            tmp_path,
        )
