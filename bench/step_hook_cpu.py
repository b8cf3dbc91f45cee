"""The CPU time EngineCore's step hooks (``agent/_steps.c``) take per step in the real server,
read by the hooks themselves, A/B across commits.

Sampling (``bench/agent_cpu_share.py``) gives EngineCore's tracing ~25 samples a run, too few
to tell two commits apart by a third of a point; the instruction counts of
``bench/engine_step_instructions.py`` are exact but miss what a step costs in the real server,
where the tracer's reads come after vLLM's step and find their memory cold. This builds, for
each ``--refs`` commit, its ``_steps.c`` with a probe added (the thread's CPU clock,
``CLOCK_THREAD_CPUTIME_ID``, read around each hook call minus the call of vLLM's own method
inside it), puts it in place of the installed extension, runs ``bench/agent_cpu_share.py``
(``--only EngineCore``, its load and its sampling) and reads what the probe wrote: the hooks'
mean CPU ns per step and their share of the busy loop thread's CPU. Commits alternate, round
by round; the installed extension is put back at the end.

    python bench/step_hook_cpu.py --refs HEAD~1,HEAD --rounds 2     # ~10 minutes

Only the C extension differs between the arms: the working tree's Python runs both (a commit
whose C needs Python the working tree lacks fails to start its hooks: see the server's log).
The probe's own clock reads (four a step, ~0.3-1 µs each here) are in both arms. Needs a C
compiler, git, vLLM and py-spy (as ``bench/agent_cpu_share.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

_ROOT: Final = Path(__file__).resolve().parent.parent
_SOURCE: Final = "agent/_steps.c"
_HEADERS: Final = ("agent/_guard.h",)
"""The headers ``_steps.c`` includes from its folder (where a commit has them)."""
PROBE_LOG_ENV: Final = "TOKENTRACE_STEP_PROBE_LOG"
"""Where the probe build appends its line every ``_LOG_EVERY`` steps (read by this bench)."""
_LOG_EVERY: Final = 500
_ORIGINAL_CALL: Final = "PyObject_Vectorcall(self->original, args, nargsf, kwnames)"
_DISPATCH: Final = "static PyObject *step_hook_vectorcall("
_HOOKS_START: Final = "static PyObject *schedule_hook("
"""The step hooks' code runs from here to ``_DISPATCH``: the calls of vLLM's method probed are
the two in it (other hooks in the file, such as the API server's, are not EngineCore's)."""

_PROBE: Final = r"""
/* bench/step_hook_cpu.py's probe: this thread's CPU time in the hooks, less vLLM's method. */
#include <stdio.h>
#include <stdlib.h>
static long long probe_hook_ns, probe_original_ns, probe_steps, probe_thread_start_ns;
static long long probe_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}
static PyObject *probe_call_original(PyObject *original, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    long long start = probe_now();
    PyObject *result = PyObject_Vectorcall(original, args, nargsf, kwnames);
    probe_original_ns += probe_now() - start;
    return result;
}
static void probe_log(void) {
    const char *path = getenv("%(env)s");
    FILE *log = path == NULL ? NULL : fopen(path, "a");
    if (log != NULL) {
        fprintf(log, "steps %%lld hook_ns %%lld thread_ns %%lld\n", probe_steps,
                probe_hook_ns - probe_original_ns, probe_now() - probe_thread_start_ns);
        fclose(log);
    }
}
static PyObject *step_hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames);
"""

_DISPATCH_PROBED: Final = r"""
static PyObject *step_hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    if (probe_thread_start_ns == 0) {
        probe_thread_start_ns = probe_now();
    }
    long long start = probe_now();
    PyObject *result = step_hook_vectorcall_unprobed(callable, args, nargsf, kwnames);
    probe_hook_ns += probe_now() - start;
    if (((StepHook *)callable)->updates && ++probe_steps %% %(every)d == 0) {
        probe_log();
    }
    return result;
}
"""


def probed_source(source: str) -> str:
    """``_steps.c`` with the probe: every call of vLLM's method measured, and the hooks'
    dispatch (``step_hook_vectorcall``) wrapped. ValueError where the source lacks either."""
    before_hooks, start, hooks_and_rest = source.partition(_HOOKS_START)
    hooks, dispatch_found, rest = hooks_and_rest.partition(_DISPATCH)
    if (
        not start
        or not dispatch_found
        or hooks.count(_ORIGINAL_CALL) != 2
        or rest.count(_DISPATCH) != 0
    ):
        raise ValueError(
            f"{_SOURCE}: expected `{_HOOKS_START}`, then two calls `{_ORIGINAL_CALL}`, then one "
            f"`{_DISPATCH}`: the probe no longer fits this source"
        )
    probe = _PROBE % {"env": PROBE_LOG_ENV}
    dispatch = _DISPATCH_PROBED % {"every": _LOG_EVERY}
    hooks = hooks.replace(
        _ORIGINAL_CALL, _ORIGINAL_CALL.replace("PyObject_Vectorcall", "probe_call_original")
    )
    body = before_hooks + start + hooks + "static PyObject *step_hook_vectorcall_unprobed(" + rest
    # Helpers after the includes (Python.h first), the wrapper after everything it calls.
    head, separator, rest = body.partition("#include <time.h>\n")
    if not separator:
        raise ValueError(f"{_SOURCE}: no `#include <time.h>` to put the probe after")
    marker = "\n/* A method: bound to the scheduler"
    before, found, after = rest.partition(marker)
    if not found:
        raise ValueError(f"{_SOURCE}: no `{marker.strip()}` comment after the dispatch")
    return head + separator + probe + before + dispatch + found + after


def build_probe(source: str, out_dir: Path, headers: Mapping[str, str] | None = None) -> Path:
    """The probed source compiled as the ``_steps`` extension module in ``out_dir``, beside
    ``headers`` (file name -> text: what it includes from its folder)."""
    c_file = out_dir / "_steps.c"
    c_file.write_text(probed_source(source))
    for name, text in (headers or {}).items():
        (out_dir / name).write_text(text)
    target = out_dir / f"_steps{sysconfig.get_config_var('EXT_SUFFIX')}"
    command = [
        *shlex.split(sysconfig.get_config_var("LDSHARED")),
        "-fPIC", "-O2", f"-I{sysconfig.get_paths()['include']}", str(c_file), "-o", str(target),
    ]  # fmt: skip
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode:
        raise RuntimeError(f"compiling the probe failed:\n{built.stderr}")
    return target


def read_probe(log: Path) -> tuple[int, float, float] | None:
    """(steps, hook CPU ns per step, hook share of the busy loop thread's CPU in %) from the
    probe's last line, or None where it wrote none."""
    lines = log.read_text().splitlines() if log.exists() else []
    match = (
        re.fullmatch(r"steps (\d+) hook_ns (-?\d+) thread_ns (\d+)", lines[-1]) if lines else None
    )
    if match is None:
        return None
    steps, hook_ns, thread_ns = (int(group) for group in match.groups())
    return steps, hook_ns / steps, 100.0 * hook_ns / thread_ns if thread_ns else 0.0


def _installed_extension() -> Path:
    from tokentrace import agent

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for folder in agent.__path__:
        candidate = Path(folder) / f"_steps{suffix}"
        if candidate.exists():
            return candidate
    raise SystemExit("tokentrace.agent._steps is not built here (make install)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", default="HEAD", help="commits, comma-separated (git rev-parse)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=90)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    args = parser.parse_args(argv)
    refs = [ref.strip() for ref in args.refs.split(",") if ref.strip()]
    installed = _installed_extension()
    sys.path.insert(0, str(_ROOT))
    from bench import agent_cpu_share

    results: dict[str, list[tuple[int, float, float]]] = {ref: [] for ref in refs}
    with tempfile.TemporaryDirectory(prefix="tokentrace-step-probe-") as tmp:
        work = Path(tmp)
        builds = {}
        for number, ref in enumerate(refs):
            shown = subprocess.run(
                ["git", "show", f"{ref}:{_SOURCE}"], cwd=_ROOT, capture_output=True, text=True
            )
            if shown.returncode:
                parser.error(f"--refs {ref}: {shown.stderr.strip()}")
            headers = {}
            for header in _HEADERS:
                found = subprocess.run(
                    ["git", "show", f"{ref}:{header}"], cwd=_ROOT, capture_output=True, text=True
                )
                if found.returncode == 0:  # older commits have none
                    headers[Path(header).name] = found.stdout
            (work / str(number)).mkdir()
            builds[ref] = build_probe(shown.stdout, work / str(number), headers)
        backup = work / "installed.so"
        shutil.copy2(installed, backup)
        log = work / "probe.log"
        os.environ[PROBE_LOG_ENV] = str(log)
        try:
            for round_number in range(args.rounds):
                order = refs if round_number % 2 == 0 else refs[::-1]
                for ref in order:
                    shutil.copy2(builds[ref], installed)
                    log.unlink(missing_ok=True)
                    print(f"round {round_number + 1}/{args.rounds}: {ref}", flush=True)
                    agent_cpu_share.main([
                        "--runs", "1", "--seconds", str(args.seconds), "--rate", str(args.rate),
                        "--tracers", agent_cpu_share.TRACER_TOKENTRACE, "--only", "EngineCore",
                    ])  # fmt: skip
                    measured = read_probe(log)
                    if measured is None:
                        print(f"  {ref}: the probe wrote nothing (were the C hooks in use?)")
                        continue
                    results[ref].append(measured)
                    steps, per_step, share = measured
                    print(f"  {ref}: {steps} steps, {per_step:,.0f} ns/step, {share:.3f} %")
        finally:
            shutil.copy2(backup, installed)
    print("\nEngineCore's step hooks, CPU per step (the probe's clock reads included):")
    for ref, runs in results.items():
        if runs:
            per_step = statistics.mean(run[1] for run in runs)
            share = statistics.mean(run[2] for run in runs)
            listed = ", ".join(f"{run[1]:,.0f}" for run in runs)
            print(
                f"  {ref:<12} {per_step:>8,.0f} ns/step ({listed})  {share:.3f} % of the busy loop"
            )
    print(
        f"reproduce: python bench/step_hook_cpu.py --refs {','.join(refs)} --rounds {args.rounds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
