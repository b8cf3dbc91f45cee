"""``tokentrace node-agent`` as a child process, for the tests that run the command itself."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

STARTED = "receiving OTLP on "
_LISTENING = re.compile(r"\b(Grpc|Http) \S+:(\d+)\b")


def listening_ports(line: str) -> dict[str, int]:
    """``{"Grpc": port, "Http": port}`` from the start line ("receiving OTLP on Grpc
    127.0.0.1:PORT, Http 127.0.0.1:PORT (plaintext, no token); ...")."""
    head = line.split(STARTED, 1)[1].split(";", 1)[0]
    return {kind: int(port) for kind, port in _LISTENING.findall(head)}


def start_node_agent(
    *args: str, env: Mapping[str, str], cwd: Path | None = None
) -> tuple[subprocess.Popen[str], int, str]:
    """Start it with an OTLP/gRPC receiver on a free loopback port (``args`` come after, so
    they may change that); returns the process, that port (read back from its start line) and
    its output up to that line."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokentrace.agent.cli",
            "node-agent",
            "--grpc-endpoint",
            "127.0.0.1:0",
            "--http-endpoint",
            "off",
            *args,
        ],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
    )
    assert process.stdout is not None
    seen = []
    for line in process.stdout:  # log lines (GPUs found, NVML missing) come first
        seen.append(line)
        if STARTED in line:
            return process, listening_ports(line)["Grpc"], "".join(seen)
    process.wait()
    raise AssertionError("node agent exited: " + "".join(seen))
