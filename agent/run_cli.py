"""``tokentrace run -- CMD ...``: run any Python command with the agent injected."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

_INJECT_DIR = Path(__file__).resolve().parent / "inject"


class RunCommand:
    name = "run"
    help = "run a command (e.g. a vLLM or SGLang server) with tokentrace instrumentation injected"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--service-name", help="service.name of the spans (OTEL_SERVICE_NAME)")
        parser.add_argument(
            "--endpoint",
            help="OTLP endpoint for the spans (OTEL_EXPORTER_OTLP_ENDPOINT; default: the "
            "node-local http://localhost:4317)",
        )
        # dest "argv": "command" is the dispatcher's name for the subcommand itself.
        parser.add_argument(
            "argv", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments"
        )

    def run(self, args: argparse.Namespace) -> int:
        command = list(args.argv)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            print("tokentrace run: nothing to run (usage: tokentrace run -- CMD)", file=sys.stderr)
            return 2
        executable = shutil.which(command[0])
        if executable is None:
            print(f"tokentrace run: command not found: {command[0]}", file=sys.stderr)
            return 127
        os.execvpe(executable, command, injected_environment(os.environ, args))
        return 0  # not reached: exec replaces this process


def injected_environment(environ: Mapping[str, str], args: argparse.Namespace) -> dict[str, str]:
    env = dict(environ)
    paths = [str(_INJECT_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if args.service_name:
        env["OTEL_SERVICE_NAME"] = args.service_name
    if args.endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.endpoint
    # vLLM and SGLang load only the plugins their allow-lists name, when they have one.
    for allow_list in ("VLLM_PLUGINS", "SGLANG_PLUGINS"):
        allowed = env.get(allow_list)
        if allowed is not None and "tokentrace" not in allowed.split(","):
            env[allow_list] = ",".join(filter(None, [*allowed.split(","), "tokentrace"]))
    return env
