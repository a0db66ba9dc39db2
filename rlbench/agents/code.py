"""A code tool: `python(code) -> what it prints`, run in the code sandbox of `rlbench.rewards` (ToRL / ReTool style).

    python = rl.agents.python_tool(timeout_s=5, memory_mb=1024)
    python(code="print(6*7)")                  # "42\\n"
    python(code="while True: pass")            # "error: timed out after 5 s (the time limit)"
    task = rl.tasks.AgentTask(train, test, tools=[python], reward=..., tool_timeout_s=None)

Each call runs the code as a new program in a fresh sandbox (`rlbench.rewards.run_python`: as root, its own
PID, mount, network, IPC and UTS namespaces, uid, cgroup and seccomp filter; `rl.rewards.sandbox_info()` says
which mode this machine has and what it guarantees). The tool is stateless: nothing (variables, imports,
files) survives from one call to the next, and the tool's description tells the model so. Standard library
only: the interpreter runs isolated (`-I -S`), without site-packages.

The code's failure is the model's to read, never an exception out of the tool: a traceback (without the
sandbox's own frames), a time limit, a memory limit, a non-zero exit, a blocked operation, or output over the
limit each come back as the tool's text, after whatever the program printed before it failed; long output is
cut in the middle to `max_output_chars`.

Concurrency: at most `max_concurrent` sandboxes run at once per process (default: the CPU count); a call waits
for a free slot before its time limit starts. Give the task `tool_timeout_s=None` (the sandbox bounds every
run) or a limit above the wait: the environment worker's limit counts the wait too.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading

from rlbench.agents.tools import Tool
from rlbench.rewards.sandbox import BWRAP_JAIL, JAIL, Limits, Run, run_python

DESCRIPTION = ("Run a Python program and return what it prints. Each call is a fresh process: nothing is kept "
               "from earlier calls, so define every variable and import you use, and print() the results. "
               "Standard library only (math, fractions, itertools, ...); the program may run {timeout_s:g} s "
               "and use {memory_mb} MB of memory.")


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 1024, max_output_chars: int = 2000,
                output_bytes: int = 1 << 20, max_concurrent: int | None = None, name: str = "python") -> Tool:
    """A `Tool` named `name` taking `code: str` that runs the code in the sandbox and returns what it printed
    (or what went wrong; see the module docstring).

    timeout_s: wall-clock seconds per run (the CPU limit is one second more, so a busy loop reads as a timeout);
    memory_mb: address space of the program; max_output_chars: longest text the model gets back (longer output
    keeps its head and tail); output_bytes: the most the program may write (past it the write fails: the run
    ends with an error); max_concurrent: sandboxes at once in this process (None: the CPU count).
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_chars < 100 or output_bytes <= 0:
        raise ValueError(f"python_tool needs timeout_s > 0, memory_mb > 0, max_output_chars >= 100 and "
                         f"output_bytes > 0; got {timeout_s}, {memory_mb}, {max_output_chars}, {output_bytes}")
    limits = Limits(cpu_s=math.ceil(timeout_s) + 1, wall_s=timeout_s, memory_mb=memory_mb, output_bytes=output_bytes)

    def python(code: str) -> str:
        with _slots(max_concurrent or os.cpu_count() or 1):
            run = run_python(code, limits=limits)
        return tool_result(run, limits, max_output_chars)

    python.__doc__ = DESCRIPTION.format(timeout_s=timeout_s, memory_mb=memory_mb) + (
        "\n\nArgs:\n    code: a complete Python program; print() what you want to see.")
    return Tool(python, name)


def tool_result(run: Run, limits: Limits, max_output_chars: int = 2000) -> str:
    """What the model reads after a sandbox run: the program's stdout (its head and tail when long), then, when
    it did not end well, a line saying why and the end of its traceback."""
    out = _cut(run.stdout, max_output_chars)
    headline, trace = _problem(run, limits)
    if run.ok:  # stderr of a program that succeeded: warnings
        headline, trace = ("stderr:", trace) if trace else ("", "")
        if not out and not trace:
            return "(the program printed nothing: print() the values you want to see)"
    parts = [out.rstrip("\n") if headline or trace else out, headline, _cut(trace, max_output_chars, keep="tail")]
    return "\n".join(part for part in parts if part)


def _problem(run: Run, limits: Limits) -> tuple[str, str]:
    """(a line on what went wrong, the program's traceback), either may be empty."""
    trace = _traceback(run.stderr)
    if run.status == "timeout":
        return f"error: timed out after {limits.wall_s:g} s (the time limit)", ""
    if run.status == "cpu_time":
        return f"error: used more than {limits.cpu_s} s of CPU time (the time limit)", ""
    if run.status == "memory":
        return f"error: out of memory (the limit is {limits.memory_mb} MB)", trace
    if run.status == "output_limit":
        return f"error: the program wrote more than {limits.output_bytes:,} bytes (the output limit) and was stopped", ""
    if run.status == "blocked":
        what = trace.split("sandbox: blocked", 1)[-1].strip()
        return (f"error: the sandbox does not allow {what} (no processes, network, or files outside the "
                f"program's directory)"), ""
    if run.status == "killed":
        number = -(run.returncode or 0)
        signame = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        return f"error: the program was killed ({signame})", ""
    if run.status == "error" and not trace:
        return f"error: the program exited with code {run.returncode}", ""
    return "", trace


def _traceback(stderr: str) -> str:
    """stderr without the sandbox's own frames (jail.py): a traceback starts at the program's (main.py) frame."""
    lines = stderr.strip("\n").splitlines()
    out, skipping = [], False
    for line in lines:
        if line.startswith((f'  File "{JAIL}"', f'  File "{BWRAP_JAIL}"')):
            skipping = True  # the jail's frame and its source line
            continue
        if skipping and line.startswith("    "):
            continue
        skipping = False
        out.append(line)
    return "\n".join(out).strip("\n")


def _cut(text: str, limit: int, keep: str = "both") -> str:
    """`text` within `limit` characters: its head and tail around a note of what was cut (or only its tail)."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit:,} characters cut ...]\n"
    if keep == "tail":
        return note.lstrip("\n") + text[-limit:]
    head = limit // 2
    return text[:head] + note + text[len(text) - (limit - head):]


@functools.cache
def _slots(n: int) -> threading.BoundedSemaphore:
    """The process's semaphore of `n` sandbox slots (one per size: a Tool stays picklable, holding only `n`)."""
    return threading.BoundedSemaphore(n)
