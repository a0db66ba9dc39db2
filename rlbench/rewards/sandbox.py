"""Running an untrusted Python program: the kernel isolates each run; nothing it does outlives it or leaves it.

    run = run_python("print(input()[::-1])", stdin="abc\\n")
    run.status, run.stdout     # ("ok", "cba\\n")
    sandbox_info()["mode"]     # "namespaces" (as root), "bwrap" (bubblewrap, not root) or "rlimits"

Code rewards and the python tool run text that a policy wrote while being optimised for reward, which is the
process that finds loopholes, so the boundary is the kernel's, not a check in Python. `sandbox_info()` says
which mode is active and what it guarantees.

"namespaces" (the parent is root; every run, in `jail.py`):
- its own PID namespace: when the program ends (or its wall clock does) every process it started dies with
  it, and nothing outside can be seen or signalled (no `kill`, no `pidfd_send_signal` reaches another run);
- its own mount namespace whose root is a tmpfs of `Limits.disk_mb` MiB: read-only binds of /usr, /lib*,
  the interpreter's prefix and four devices (null, zero, random, urandom); the only writable place is /work
  on that tmpfs, the program's directory, which disappears with the namespace (no /tmp, /dev/shm, /proc,
  /etc or project tree exist there);
- its own network namespace with no interface up: no socket of any family reaches outside, and a
  filesystem (Unix) socket of the host cannot be named because no host path is visible; IPC and UTS too;
- a uid of its own (2,000,000,000 + the launcher's pid: unique among the runs alive), no groups, no
  capabilities, `no_new_privs`, a seccomp filter that denies what a program never needs (ptrace, mount,
  unshare/setns and namespace flags to clone, keyctl, bpf, perf_event_open, io_uring, module and clock
  calls, ...) and kills a foreign syscall ABI;
- limits for the run as a whole where the parent's cgroup can be divided (v1 here, or v2 with the
  controllers delegated): processes (`pids.max`), memory including its tmpfs (`memory.max`), one CPU
  (`cpu.max`); and always, per process, rlimits on CPU seconds, address space, file size (the output limit),
  open files, no core dumps, and RLIMIT_NPROC for its uid (which is the run's own, so a per-run cap);
- the wall clock, enforced by the launcher (outside the namespace), which kills the namespace's init.

"bwrap" (not root, bubblewrap installed and allowed to make a user namespace): bubblewrap builds the same
namespaces and root, drops every capability and loads the same seccomp filter; `jail.py` then forks the
program and reports its exit status. Memory is limited per process only (no cgroup), and RLIMIT_NPROC caps
a run's processes in its own user namespace. (Forced as root, `mode="bwrap"` runs in a cgroup too: the
kernel does not apply RLIMIT_NPROC to root.)

"rlimits" (neither): the program runs as the caller's user in a throwaway directory with the rlimits above
and a network namespace where an unprivileged user may make one; the first run warns, naming what is
missing. Run as root (in a container: with CAP_SYS_ADMIN) or install bubblewrap for a real boundary.

In every mode an audit hook is an extra tripwire (unless `tripwire=False`, kernel modes only): sockets,
processes, signals, ctypes, gc introspection and files outside the program's directory end the run as
"blocked" with a message a model can read. It is not the boundary: a determined program can get around it,
and the kernel's layers then hold.

The parent never touches a path the program can write: stdin, stdout and stderr are unnamed files, the
program's files are written by the run's init (or supervisor) into a tmpfs nobody else has seen, and that
tmpfs is gone with its namespace ("rlimits" mode removes its directory without following links, and a
directory it cannot remove is the program's failure). A run's status comes from the sandbox (exit status,
signal, the wall clock, the cgroup's counters); the program's text only tells failures apart. `check` code
(a test's asserts) counts only if the per-run random token printed after it arrives: a program that exits
early (`sys.exit(0)`, `os._exit(0)`) before the asserts fails.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlbench.rewards.jail import SYSCALLS, Cgroup, seccomp_filter

BLOCKED_EXIT = 125
"""Exit code of a program the audit hook stopped."""

UID_BASE = 2_000_000_000
"""A run's uid is this plus its launcher's pid (no account has it; pids are below 2**22)."""

JAIL = Path(__file__).with_name("jail.py")
BWRAP_JAIL = "/rlbench/jail.py"
"""Where bubblewrap shows JAIL inside the run."""
_log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's failure)."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    """CPU seconds per process (RLIMIT_CPU); past it the kernel sends SIGXCPU."""
    wall_s: float = 5.0
    """Wall-clock seconds of the whole run; then every process of it is killed."""
    memory_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS: a larger allocation raises MemoryError); with a cgroup,
    the memory of the whole run is capped at memory_mb + disk_mb."""
    processes: int = 8
    """Processes and threads of the run (RLIMIT_NPROC of its own uid, and pids.max with a cgroup)."""
    output_bytes: int = 1 << 20
    """Largest stdout, stderr or written file (RLIMIT_FSIZE); a write past it fails (EFBIG, "output_limit")."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    disk_mb: int = 64
    """Size of the run's tmpfs, its only writable place ("namespaces" and "bwrap" modes)."""
    disk_inodes: int = 4096
    """Files and directories the tmpfs may hold ("namespaces" mode)."""


@dataclass(frozen=True)
class Run:
    status: str
    """"ok" (exit 0, and the check token when there was check code), "early_exit" (exit 0 without the token),
    "error" (non-zero exit, or a program that does not compile: a syntax error, a NUL byte, text that is not UTF-8), "timeout" (wall clock), "cpu_time", "memory", "output_limit", "blocked" (the
    audit hook stopped it), or "killed" (another signal)."""
    returncode: int | None
    """The program's exit code, or minus the signal that ended it (-9 after the wall clock)."""
    stdout: str
    stderr: str
    wall_s: float
    isolation: dict = field(default_factory=dict)
    """What applied to this run: {"mode", "uid", "network_namespace", "cgroup", "audit_hook"}, and with a
    cgroup how often it met its limits ("oom_kills", "pids_max_hits")."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def reason(self) -> str:
        """One line on why it did not succeed ("" when it did)."""
        if self.ok:
            return ""
        if self.status == "early_exit":
            return "early_exit (exit code 0): the program exited before its checks finished"
        last = self.stderr.strip().splitlines()[-1:] or [""]
        return f"{self.status} (exit code {self.returncode}): {last[0][:300]}"


def run_python(code: str, *, stdin: str = "", files: dict[str, str] | None = None, limits: Limits = Limits(),
               check: str | None = None, tripwire: bool = True, mode: str | None = None) -> Run:
    """Run `code` as a program (`__name__ == "__main__"`, file main.py) in the sandbox; `files` ({name: text},
    plain names) are written beside it. `check` is code run after the program in its namespace (assertions):
    the run is "ok" only if the program and the check both finish, proven by a random token printed after the
    check, which `stdout` does not include. `tripwire=False` drops the audit hook, so that a program may start
    processes (multiprocessing, subprocess) inside its run; only in "namespaces" mode, where the kernel's
    isolation stays. `mode`: one of `sandbox_info()["available"]` (default: the strongest)."""
    info = sandbox_info()
    mode = mode or info["mode"]
    if mode not in info["available"]:
        raise SandboxError(f"sandbox mode {mode!r} is not available here; available: {info['available']} "
                           f"(missing: {'; '.join(info['missing']) or 'nothing'})")
    if mode == "rlimits":
        if not tripwire:
            raise SandboxError("tripwire=False needs the kernel's isolation ('namespaces' or 'bwrap' mode), and "
                               "this machine lacks: " + "; ".join(info["missing"]))
        if info["mode"] == "rlimits":
            _warn_weak(tuple(info["missing"]))
    return _run(mode, code, stdin, files or {}, limits, check, tripwire)


@functools.cache
def sandbox_info() -> dict:
    """Which isolation `run_python` uses on this machine and what it guarantees, checked once per process with
    a trial run of each mode: {"mode": the strongest, "available": [modes that work here], "guarantees":
    [...], "missing": [what the strongest mode lacks, and why a stronger one is not used], "cgroup": "v1" |
    "v2" | None, "seccomp": bool}. Modes, strongest first: "namespaces" (root), "bwrap" (bubblewrap), "rlimits"."""
    machine = os.uname().machine
    why_not = {}  # mode -> why it is not available here
    if os.geteuid() != 0:
        why_not["namespaces"] = ("root (in a container: CAP_SYS_ADMIN), for rlbench's own namespaces with a uid "
                                 "and a cgroup per run")
    if not shutil.which("bwrap"):
        why_not["bwrap"] = ("bubblewrap (`apt install bubblewrap`, `dnf install bubblewrap`), for the kernel's "
                            "isolation without root")
    for mode in ("namespaces", "bwrap"):
        if mode not in why_not and machine not in SYSCALLS:
            why_not[mode] = f"a seccomp syscall table for {machine} (rlbench has {sorted(SYSCALLS)})"
        if mode not in why_not:
            why_not.update({mode: reason for reason in [_trial(mode)] if reason})
    available = [m for m in ("namespaces", "bwrap") if m not in why_not] + ["rlimits"]
    mode = available[0]
    cgroup = _cgroup_bases()[0] if mode == "namespaces" else None
    if mode == "namespaces":
        missing = [] if cgroup else ["a cgroup rlbench may divide (v1 pids/memory/cpu, or v2 with them in the "
                                     "parent's cgroup.subtree_control): limits are per process, not per run"]
    elif mode == "bwrap":
        missing = [why_not["namespaces"], *_GUARANTEES["bwrap lacks"]]
    else:
        missing = [why_not["namespaces"], why_not["bwrap"]]
    return {"mode": mode, "available": available, "cgroup": cgroup, "seccomp": mode != "rlimits",
            "missing": missing, "guarantees": _GUARANTEES[mode] + ([_GUARANTEES["cgroup"]] if cgroup else [])}


def _trial(mode: str) -> str | None:
    """None if a trial run in `mode` prints what it should, else why not."""
    try:
        trial = _run(mode, "print(6 * 7)", "", {}, Limits(wall_s=30.0), None)
    except (OSError, SandboxError) as e:
        return f"a working {mode!r} sandbox ({e})"
    if trial.stdout != "42\n":
        return f"a working {mode!r} sandbox (a trial run printed {trial.stdout!r}: {trial.reason})"
    return None


_GUARANTEES = {
    "namespaces": [
        "PID namespace: every process of a run dies with it; nothing outside it can be seen or signalled",
        "mount namespace: read-only /usr, /lib and the interpreter; writable only /work, a private tmpfs of "
        "disk_mb MiB that disappears with the run (no host /tmp, /dev/shm, /proc, /etc or project files)",
        "network namespace, no interface up: no socket of any family reaches outside (filesystem sockets: "
        "no host path is visible); IPC and UTS namespaces",
        "a uid of its own per run, no groups or capabilities, no_new_privs, a seccomp filter (ptrace, mount, "
        "namespaces, keyctl, bpf, perf_event_open, io_uring, modules, clocks, ... denied)",
        "rlimits per process (CPU, address space, file size, open files, no core), RLIMIT_NPROC per run",
        "the wall clock, enforced outside the run; an audit hook as an extra tripwire",
    ],
    "bwrap": [
        "bubblewrap's user, PID, mount, network, IPC and UTS namespaces: every process of a run dies with it; "
        "nothing outside it can be seen or signalled; no socket reaches outside",
        "read-only /usr, /lib and the interpreter; writable only /work, a private tmpfs of disk_mb MiB",
        "no capabilities, no_new_privs, no nested user namespaces, rlbench's seccomp filter",
        "rlimits per process (CPU, address space, file size, open files, no core); the wall clock, enforced "
        "outside the run; an audit hook as an extra tripwire",
    ],
    "bwrap lacks": [
        "a cgroup per run: memory is limited per process (up to processes x memory_mb for a run)",
        "a uid per run (every run has the caller's uid outside its user namespace)",
    ],
    "rlimits": [
        "rlimits per process (CPU, address space, file size, open files, no core)",
        "a network namespace where the kernel lets this user make one",
        "the wall clock, enforced by the parent on the run's process group; an audit hook as a tripwire "
        "(NOT a boundary: the program runs as this user and can read what this user can)",
    ],
    "cgroup": "a cgroup per run: pids.max, memory (memory_mb + disk_mb, its tmpfs included), one CPU",
}


@functools.cache
def _warn_weak(missing: tuple[str, ...]) -> None:
    warnings.warn("rlbench's code sandbox runs in its weaker 'rlimits' mode: model-written code runs as this "
                  "user and is not isolated by the kernel. Missing: " + "; ".join(missing), stacklevel=3)


def _run(mode: str, code: str, stdin: str, files: dict[str, str], limits: Limits, check: str | None,
         tripwire: bool = True) -> Run:
    for name in files:
        if not name or name in (".", "..", "main.py") or "/" in name or "\0" in name:
            raise ValueError(f"file name {name!r} is not allowed in the sandbox: use a plain name (not main.py)")
    try:
        code.encode()
    except UnicodeEncodeError as e:  # (a lone surrogate): no file can hold it, and it is the program's fault
        return Run("error", None, "", f"SyntaxError: the program is not UTF-8 text: {e.reason} at character {e.start}",
                   0.0, {"mode": mode})
    token = secrets.token_hex(16) if check is not None else None
    # "bwrap" as root too: bubblewrap's RLIMIT_NPROC does not hold for root, the cgroup's pids.max does
    cgroup = _cgroup_bases()[1] if mode == "namespaces" or (mode == "bwrap" and os.geteuid() == 0) else None
    spec = {"mode": mode, "limits": asdict(limits), "files": {"main.py": code, **files}, "check": check,
            "token": token, "uid_base": UID_BASE, "cgroup": cgroup, "read_only": _read_only_paths(),
            "tripwire": tripwire}
    work = tempfile.mkdtemp(prefix="rlbench-sandbox-") if mode == "rlimits" else None
    not_removed = None
    try:
        if work is not None:
            for name, text in spec["files"].items():
                Path(work, name).write_text(text)
            spec["work"] = work
        returncode, timed_out, report, out, err, wall_s = _launch(spec, stdin, limits)
    finally:
        if work is not None:
            not_removed = _remove(work)
    if not_removed:  # what the program left behind could not be removed: that is the program's failure
        returncode, err = returncode or 1, err + f"\nsandbox: could not remove the program's directory: {not_removed}\n"
    if "error" in report:  # written before the program starts (then its status pipe is closed): ours
        raise SandboxError(report["error"] + (f"\n{err.strip()}" if err.strip() else ""))
    proven = check is None
    if check is not None and out.endswith("\n" + token + "\n"):
        out, proven = out[:-len(token) - 2], True
    isolation = {"mode": mode, "audit_hook": tripwire, "cgroup": bool(cgroup),
                 "network_namespace": report.get("network_namespace", mode != "rlimits")}
    isolation.update({k: report[k] for k in ("uid", "oom_kills", "pids_max_hits") if k in report})
    if report.get("cleanup_failed"):
        _log.warning("the sandbox could not remove %s", report["cleanup_failed"])
    return Run(_status(returncode, timed_out, err, report, proven), returncode, out, err, wall_s, isolation)


def _launch(spec: dict, stdin: str, limits: Limits):
    """Start the jail (in bubblewrap in "bwrap" mode), wait for it; (returncode, timed out, its report, stdout,
    stderr, wall seconds)."""
    bwrap = spec["mode"] == "bwrap"
    with contextlib.ExitStack() as files:
        fin, fout, ferr, fspec, fseccomp = (files.enter_context(tempfile.TemporaryFile()) for _ in range(5))
        fin.write(stdin.encode())
        fspec.write(marshal.dumps(spec))
        fseccomp.write(seccomp_filter(os.uname().machine) if bwrap else b"")
        for f in (fin, fspec, fseccomp):
            f.seek(0)
        status_read, status_write = os.pipe()
        bwrap_read, bwrap_write = os.pipe() if bwrap else (None, None)
        fds = (fspec.fileno(), status_write) + ((fseccomp.fileno(), bwrap_write) if bwrap else ())
        jail = BWRAP_JAIL if bwrap else str(JAIL)
        argv = [_interpreter(), "-I", "-S", "-B", jail, str(fspec.fileno()), str(status_write)]
        if bwrap:
            argv = _bwrap_argv(spec["limits"], fseccomp.fileno(), bwrap_write) + argv
        if bwrap and spec["cgroup"]:  # the jail joins the cgroup, then becomes bubblewrap
            argv = [_interpreter(), "-I", "-S", "-B", str(JAIL), str(fspec.fileno()), str(status_write), "--", *argv]
        start = time.monotonic()
        try:
            process = subprocess.Popen(argv, cwd="/", env={"LANG": "C.UTF-8"}, stdin=fin, stdout=fout, stderr=ferr,
                                       pass_fds=fds, start_new_session=True)
        finally:
            for fd in (status_write, bwrap_write):
                if fd is not None:
                    os.close(fd)
        init = _bwrap_init(bwrap_read) if bwrap else None
        # "namespaces": the launcher keeps the wall clock (this is in case it is stuck); else the parent does
        grace = 10.0 if spec["mode"] == "namespaces" else 0.0
        with open(status_read, "rb") as status:
            try:
                timed_out = not _wait(process, limits.wall_s + grace)
            finally:
                try:  # the launcher's group: the init dies with it (PDEATHSIG), and the namespace with the init
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
                if init is not None:  # bwrap's init: gone once every process of the namespace is
                    with open(init, "rb") as f:
                        if not select.select([f], [], [], 10.0)[0]:
                            _log.warning("the sandbox's bwrap namespace outlived its run by 10 s")
            wall_s = time.monotonic() - start
            report = {}
            for line in status.read().decode(errors="replace").splitlines():
                report.update(ast.literal_eval(line))
            if bwrap and spec["cgroup"]:
                cgroup = Cgroup(spec["cgroup"], process.pid)
                report.update(cgroup.counters(), cleanup_failed=cgroup.remove())
        out, err = _read(fout, limits.output_bytes), _read(ferr, limits.output_bytes)
    timed_out = timed_out or report.get("timeout", False)
    if "signal" in report:
        returncode = -report["signal"]
    elif "exit" in report:
        returncode = report["exit"]
    else:
        returncode = process.returncode
    if timed_out:
        returncode = -signal.SIGKILL
    return returncode, timed_out, report, out, err, wall_s


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the process ended within `timeout_s` (a pidfd on Linux: Popen.wait polls in steps of 50 ms)."""
    if not hasattr(os, "pidfd_open"):
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    with open(os.pidfd_open(process.pid), "rb") as exited:
        return bool(select.select([exited], [], [], timeout_s)[0])


def _bwrap_argv(limits: dict, seccomp_fd: int, status_fd: int) -> list[str]:
    argv = [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--uid", "1000", "--gid", "1000", "--cap-drop", "ALL"]
    for path in _read_only_paths():
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for device in ("null", "zero", "random", "urandom"):
        argv += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    return argv + ["--ro-bind", str(JAIL), BWRAP_JAIL, "--perms", "0700", "--size",
                   str(limits["disk_mb"] << 20), "--tmpfs", "/work", "--chdir", "/work", "--seccomp", str(seccomp_fd),
                   "--json-status-fd", str(status_fd), "--"]


def _bwrap_init(status_fd: int) -> int | None:
    """A pidfd of bwrap's init (PID 1 of the run), from the first line bwrap writes; None if it is gone."""
    with open(status_fd, "rb") as f:
        line = f.readline() if select.select([f], [], [], 30.0)[0] else b""
    try:
        return os.pidfd_open(json.loads(line)["child-pid"])
    except (ValueError, KeyError, ProcessLookupError):
        return None


def _status(returncode: int, timed_out: bool, stderr: str, report: dict, proven: bool) -> str:
    """From the sandbox's facts; the program's text only tells failures apart (MemoryError, EFBIG, blocked)."""
    if timed_out:
        return "timeout"
    if report.get("oom_kills"):
        return "memory"
    if returncode == 0:
        return "ok" if proven else "early_exit"
    if returncode == BLOCKED_EXIT and "sandbox: blocked" in stderr:
        return "blocked"
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:  # CPython ignores SIGXFSZ: EFBIG
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if returncode < 0 else "error"


def _read(file, limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode("utf-8", errors="replace")


def _remove(path: str) -> str | None:
    """Remove an "rlimits"-mode work directory (never following a link); why it could not be, logged, or None.
    Never raises: shutil.rmtree recurses per level (3000 nested directories raise RecursionError), so `rm -rf`
    takes over where it fails."""
    try:
        shutil.rmtree(path)
        return None
    except BaseException as e:
        why = f"{type(e).__name__}: {e}"
    try:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        why += f"; rm -rf: {e}"
    if not os.path.lexists(path):
        return None
    _log.warning("the sandbox could not remove %s: %s", path, why)
    return why


def _interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.cache
def _read_only_paths() -> list[str]:
    """What the run sees of the host, read-only: the system's programs and libraries, the interpreter's prefix."""
    prefix = os.path.realpath(sys.base_prefix)
    paths = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache"]
    if not prefix.startswith("/usr/"):
        paths.append(prefix)
    return paths


@functools.cache
def _cgroup_bases() -> tuple[str | None, dict[str, str] | None]:
    """("v1" | "v2", {controller: the directory of this process's cgroup}) if rlbench may make cgroups under
    it, else (None, None). v2 needs pids, memory and cpu in the parent's cgroup.subtree_control already:
    rlbench does not change the caller's cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    v1, v2 = {}, None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            v2 = path
        for controller in controllers.split(","):
            v1[controller] = path
    root = Path("/sys/fs/cgroup")
    candidates = []
    if all((root / c / "cgroup.procs").exists() and c in v1 for c in ("pids", "memory", "cpu")):
        candidates.append(("v1", {c: str(root / c) + v1[c].rstrip("/") for c in ("pids", "memory", "cpu")}))
    if v2 is not None and (root / "cgroup.controllers").exists():
        base = str(root) + v2.rstrip("/")
        try:
            delegated = set(Path(base, "cgroup.subtree_control").read_text().split())
        except OSError:
            delegated = set()
        if {"pids", "memory", "cpu"} <= delegated:
            candidates.append(("v2", {"": base}))
    for kind, bases in candidates:
        probes = [os.path.join(base, f"rlbench-sandbox-probe-{os.getpid()}") for base in bases.values()]
        try:
            for probe in probes:
                os.mkdir(probe)
                os.rmdir(probe)
            return kind, bases
        except OSError:
            continue
    return None, None
