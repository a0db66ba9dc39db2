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
- a uid of its own (2,000,000,000 + a random number below 2**30, reserved by creating the run's cgroup
  "rlbench-sandbox-<uid>": unique among the runs alive on the host's cgroup tree, whatever their PID
  namespaces), no groups, no capabilities, `no_new_privs`, a seccomp filter that denies what a program never
  needs (ptrace, mount, unshare/setns and namespace flags to clone, keyctl, bpf, perf_event_open, io_uring and
  io_setup/io_submit, sockets of any family but AF_UNIX, module and clock calls, ...) and kills a foreign
  syscall ABI;
- limits for the run as a whole where the parent's cgroup can be divided (v1 here, or v2 with the
  controllers delegated): processes (`pids.max`), memory including its tmpfs (`memory.max`, the whole run
  killed at once on v2's `memory.oom.group`), one CPU (`cpu.max`); and always, per process, rlimits on CPU
  seconds, address space, file size (the output limit), open files, no core dumps, and RLIMIT_NPROC for its
  uid (which is the run's own, so a per-run cap);
- a supervisor that the run cannot exhaust: the launcher stays outside the run's cgroup (only the namespace's
  init joins it), so an out-of-memory run kills its own processes and is reported as "memory"; the parent
  removes the cgroup afterwards, and the next process to start the sandbox removes any left by a killed one
  (their lock, held while the parent lives, is free);
- the wall clock, enforced by the launcher (outside the namespace), which kills the namespace's init.

"bwrap" (not root, bubblewrap installed and allowed to make a user namespace): bubblewrap builds the same
namespaces and root, drops every capability and loads the same seccomp filter; `jail.py` is the run's PID 1
(bubblewrap reaps it), forks the program and reports its exit status. Memory is limited per process only (no
cgroup), and RLIMIT_NPROC caps a run's processes in its own user namespace; every run has the caller's uid
outside it. (Forced as root, `mode="bwrap"` runs in a cgroup too, since the kernel does not apply RLIMIT_NPROC
to root, and binds device nodes of its own owned by nobody, since the run's root would own the host's.)

"rlimits" (neither): per-process rlimits in a throwaway directory, a network namespace where the user may make
one, and the audit hook: no kernel boundary, so it is never chosen silently (`mode="rlimits"`,
`RLBENCH_SANDBOX=rlimits` or `Session(sandbox="rlimits")`). As root the program runs as a uid of its own that
owns only its directory, or the mode is refused where that uid could not read the interpreter. The first run
in a mode that lacks a guarantee warns, naming it; `sandbox_info()["lacks"]` lists them. Run as root (in a
container: with CAP_SYS_ADMIN) or install bubblewrap for a real boundary.

In every mode an audit hook is an extra tripwire (unless `tripwire=False`, kernel modes only): sockets,
processes, signals, ctypes, gc introspection and files outside the program's directory end the run as
"blocked" with a message a model can read. It is not the boundary: a determined program can get around it,
and the kernel's layers then hold.

The parent never touches a path the program can write: stdin, stdout and stderr are memfds (stdin sealed;
stdout and stderr bounded by RLIMIT_FSIZE, `fallocate` included, and on no disk), the program's files are written by the run's init (or supervisor) into a tmpfs nobody else has seen, and that
tmpfs is gone with its namespace ("rlimits" mode removes its directory without following links, and a
directory it cannot remove is the program's failure). A run's status comes from the sandbox (exit status,
signal, the wall clock, the cgroup's counters); the program's text only tells failures apart. `check` code
counts only if the per-run random token printed after it arrives: a program that exits early (`sys.exit(0)`,
`os._exit(0)`) before it fails, but the token is in the program's own interpreter, which a program written to
can reach (`code_reward` therefore keeps expected values on the host, see `code.py`). A program that cannot
start (a syntax error, a NUL byte, text that is not UTF-8, files that do not fit its disk) is its run's "error";
a run the sandbox could not start is "sandbox_error", logged; neither raises.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import json
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlbench.rewards.jail import SYSCALLS, Cgroup, seccomp_filter

BLOCKED_EXIT = 125
"""Exit code of a program the audit hook stopped."""

UID_BASE = 2_000_000_000
"""A run's uid is this plus a random number below UID_RANGE (no account has one)."""

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
    "error" (non-zero exit, or a program that does not start: a syntax error, a NUL byte, text that is not
    UTF-8, files that do not fit its disk), "timeout" (wall clock), "cpu_time", "memory", "output_limit",
    "blocked" (the audit hook stopped it), "killed" (another signal), or "sandbox_error" (the sandbox could not
    run it: logged as a warning, a failed run like the others)."""
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
    processes (multiprocessing, subprocess) inside its run; only with the kernel's isolation.

    `mode`: one of `sandbox_info()["available"]`; default: `$RLBENCH_SANDBOX` if set (how `Session(sandbox=...)`
    tells its workers), else the strongest. Where the strongest is "rlimits" (no kernel isolation) it must be
    chosen: a silent weak mode is a SandboxError. The first run in a mode that lacks a guarantee warns, naming it.
    Whatever the program does is its run's status, never an exception; SandboxError means the sandbox itself
    cannot work here (no mode works, or the mode asked for is not available)."""
    info, mode_given = sandbox_info(), mode is not None
    if not info["available"]:
        raise SandboxError("no sandbox mode works here, so no model-written code can run: " + "; ".join(
            f"{mode}: {why}" for mode, why in info["why_not"].items()))
    chosen = mode or os.environ.get("RLBENCH_SANDBOX") or None
    if chosen is None and info["mode"] != "namespaces" and "bwrap" not in info["available"]:
        raise SandboxError("this machine has no kernel isolation for model-written code (missing: "
                           f"{'; '.join(info['missing'])}). To run it with rlimits and a tripwire only, as this "
                           "user, choose that: Session(..., sandbox='rlimits'), mode='rlimits', or "
                           "RLBENCH_SANDBOX=rlimits")
    mode = chosen or info["mode"]
    if mode not in info["available"]:
        source = " (from $RLBENCH_SANDBOX)" if mode == os.environ.get("RLBENCH_SANDBOX") and not mode_given else ""
        raise SandboxError(f"sandbox mode {mode!r}{source} is not available here; available: {info['available']} "
                           f"(missing: {'; '.join(info['why_not'].values()) or 'nothing'})")
    if mode == "rlimits" and not tripwire:
        raise SandboxError("tripwire=False needs the kernel's isolation ('namespaces' or 'bwrap' mode), and "
                           "this machine lacks: " + "; ".join(info["missing"]))
    if _lacks(mode):
        _warn_weak(mode, tuple(_lacks(mode)))
    return _run(mode, code, stdin, files or {}, limits, check, tripwire)


@functools.cache
def sandbox_info() -> dict:
    """Which isolation `run_python` uses on this machine and what it guarantees, checked once per process with
    a trial run of each mode: {"mode": the strongest (None if none works), "available": [modes that work here],
    "guarantees": [...], "lacks": [the guarantees of the strongest kind that this mode does not give], "missing":
    [why a stronger mode is not used], "why_not": {mode: why it does not work here}, "cgroup": "v1" | "v2" | None,
    "seccomp": bool}. Modes, strongest first: "namespaces" (root), "bwrap" (bubblewrap), "rlimits" (no kernel
    isolation: chosen explicitly only)."""
    machine = os.uname().machine
    why_not = {}  # mode -> why it is not available here
    if os.geteuid() != 0:
        why_not["namespaces"] = ("root (in a container: CAP_SYS_ADMIN), for rlbench's own namespaces with a uid "
                                 "and a cgroup per run")
    if not shutil.which("bwrap"):
        why_not["bwrap"] = ("bubblewrap (`apt install bubblewrap`, `dnf install bubblewrap`), for the kernel's "
                            "isolation without root")
    unreadable = _unreadable_by_others() if os.geteuid() == 0 else None
    if unreadable:
        why_not["rlimits"] = (f"(rlimits as root) an interpreter other users can read, to run the program as a uid "
                              f"of its own ({unreadable} is not)")
    for mode in ("namespaces", "bwrap"):
        if mode not in why_not and machine not in SYSCALLS:
            why_not[mode] = f"a seccomp syscall table for {machine} (rlbench has {sorted(SYSCALLS)})"
    for mode in MODES:
        if mode not in why_not:
            why_not.update({mode: reason for reason in [_trial(mode)] if reason})
    available = [m for m in MODES if m not in why_not]
    mode = available[0] if available else None
    cgroup = _cgroup_bases()[0] if mode == "namespaces" else None
    stronger = MODES[:MODES.index(mode)] if mode else MODES
    return {"mode": mode, "available": available, "cgroup": cgroup, "seccomp": mode in ("namespaces", "bwrap"),
            "missing": [why_not[m] for m in stronger], "why_not": why_not, "lacks": _lacks(mode) if mode else [],
            "guarantees": (_GUARANTEES[mode] + ([_GUARANTEES["cgroup"]] if cgroup else [])) if mode else []}


MODES = ("namespaces", "bwrap", "rlimits")


def _trial(mode: str) -> str | None:
    """None if a trial run in `mode` prints what it should, else why not."""
    trial = _run(mode, "import json\nprint(6 * 7)", "", {}, Limits(wall_s=30.0), None)
    if trial.stdout != "42\n":
        return f"a working {mode!r} sandbox (a trial run printed {trial.stdout!r}: {trial.reason})"
    return None


def _lacks(mode: str) -> list[str]:
    """The guarantees of the strongest kind ("namespaces" with a cgroup) that `mode` does not give here."""
    cgroup = _cgroup_bases()[0] is not None
    if mode == "namespaces":
        return [] if cgroup else ["a cgroup per run (rlbench may divide no v1 pids/memory/cpu, nor a v2 cgroup with "
                                  "them in the parent's cgroup.subtree_control): limits are per process, not per run"]
    if mode == "bwrap":
        root = os.geteuid() == 0
        return ([] if root and cgroup else [_LACKS["cgroup"]]) + [_LACKS["bwrap uid"]]
    return [_LACKS[key] for key in ("kernel", "cgroup")] + ([] if os.geteuid() == 0 else [_LACKS["rlimits uid"]])


_LACKS = {
    "cgroup": "a cgroup per run: memory is limited per process (up to processes x memory_mb for a run), and the "
              "run's CPU share is not capped",
    "bwrap uid": "a uid per run: outside its user namespace every run has the caller's uid (as root: uid 0 without "
                 "capabilities), so runs share per-user kernel limits",
    "kernel": "the kernel's isolation: no PID, mount, IPC or UTS namespace and no seccomp filter; the audit hook "
              "is a tripwire a determined program gets around (files, processes, signals of this user)",
    "rlimits uid": "a uid per run: the program runs as this user and can read, write and signal what it can",
}


_GUARANTEES = {
    "namespaces": [
        "PID namespace: every process of a run dies with it; nothing outside it can be seen or signalled",
        "mount namespace: read-only /usr, /lib, the interpreter and four devices; writable only /work, a private "
        "tmpfs of disk_mb MiB that disappears with the run (no host /tmp, /dev/shm, /proc, /etc or project files)",
        "network namespace, no interface up, and only AF_UNIX sockets: no socket reaches outside (filesystem "
        "sockets: no host path is visible); IPC and UTS namespaces",
        "a uid of its own per run, no groups or capabilities, no_new_privs, a seccomp filter (ptrace, mount, "
        "namespaces, keyctl, bpf, perf_event_open, io_uring, aio, modules, clocks, ... denied)",
        "rlimits per process (CPU, address space, file size, open files, no core), RLIMIT_NPROC per run",
        "stdin, stdout and stderr in memory (memfd), bounded by output_bytes: nothing on the host's disk",
        "the wall clock, enforced outside the run; an audit hook as an extra tripwire",
    ],
    "bwrap": [
        "bubblewrap's user, PID, mount, network, IPC and UTS namespaces: every process of a run dies with it; "
        "nothing outside it can be seen or signalled; only AF_UNIX sockets, and none reaches outside",
        "read-only /usr, /lib and the interpreter; writable only /work, a private tmpfs of disk_mb MiB; devices "
        "whose inodes the run cannot change",
        "no capabilities, no_new_privs, no nested user namespaces, rlbench's seccomp filter",
        "rlimits per process (CPU, address space, file size, open files, no core), RLIMIT_NPROC per run; stdin, "
        "stdout and stderr in memory; the wall clock, enforced outside the run; an audit hook as a tripwire",
    ],
    "rlimits": [
        "rlimits per process (CPU, address space, file size, open files, no core)",
        "a network namespace where the kernel lets this user make one; as root, a uid of its own per run",
        "the wall clock, enforced by the parent on the run's process group; an audit hook as a tripwire "
        "(NOT a boundary)",
    ],
    "cgroup": "a cgroup per run: pids.max, memory (memory_mb + disk_mb, its tmpfs included), one CPU; the launcher "
              "is outside it, so a run exhausts nothing but itself",
}


@functools.cache
def _warn_weak(mode: str, lacks: tuple[str, ...]) -> None:
    warnings.warn(f"rlbench's code sandbox runs model-written code in its {mode!r} mode, which lacks: "
                  + "; ".join(lacks), stacklevel=3)


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
    spec = {"mode": mode, "limits": asdict(limits), "files": {"main.py": code, **files}, "check": check,
            "token": token, "read_only": _read_only_paths(), "tripwire": tripwire}
    root = os.geteuid() == 0
    # "bwrap" as root too: bubblewrap's RLIMIT_NPROC does not hold for root, the cgroup's pids.max does
    bases = _cgroup_bases()[1] if mode == "namespaces" or (mode == "bwrap" and root) else None
    leftover = []
    try:
        with _reserved(bases, limits) as (uid, cgroup), _private_dir(mode, root, leftover) as folder:
            spec.update(uid=uid, cgroup=cgroup and cgroup.bases, cgroup_name=cgroup and cgroup.name)
            if mode == "rlimits":
                for name, text in spec["files"].items():
                    Path(folder, name).write_text(text)
                spec["work"] = folder
            devices = folder if mode == "bwrap" else None
            returncode, timed_out, report, out, err, wall_s = _launch(spec, stdin, limits, cgroup, devices)
            if cgroup is not None:
                report.update(cgroup.counters())
    except OSError as e:  # the sandbox could not run this program (a missing interpreter, ...)
        _log.warning("the sandbox could not run a program: %s", e)
        return Run("sandbox_error", None, "", f"sandbox: could not run the program: {type(e).__name__}: {e}", 0.0,
                   {"mode": mode})
    if "error" in report:  # written by the jail before the program starts: the sandbox's failure, not the program's
        _log.warning("the sandbox could not run a program: %s", report["error"])
        return Run("sandbox_error", None, out, f"sandbox: {report['error']}\n{err.strip()}".strip(), wall_s,
                   {"mode": mode})
    if "refused" in report:  # the program cannot start for its own reasons (its files do not fit its disk)
        return Run("error", None, out, f"sandbox: {report['refused']}", wall_s, {"mode": mode})
    if leftover:  # what the program left behind could not be removed: that is the program's failure
        returncode, err = returncode or 1, err + f"\nsandbox: could not remove the program's directory: {leftover[0]}\n"
    proven = check is None
    if check is not None and out.endswith("\n" + token + "\n"):
        out, proven = out[:-len(token) - 2], True
    isolation = {"mode": mode, "audit_hook": tripwire, "cgroup": bool(bases),
                 "network_namespace": report.get("network_namespace", mode != "rlimits")}
    if mode == "namespaces":
        isolation["uid"] = uid
    isolation.update({k: report[k] for k in ("uid", "oom_kills", "pids_max_hits") if k in report})
    return Run(_status(returncode, timed_out, err, report, proven), returncode, out, err, wall_s, isolation)


UID_RANGE = 1 << 30
_uids_alive: set[int] = set()
_uids_lock = threading.Lock()


@contextlib.contextmanager
def _reserved(bases: dict | None, limits: Limits):
    """(a uid no other live run has, its cgroup or None) for one run: a random uid of UID_BASE + [0, 2**30), taken
    in this process by a set and across processes by creating the cgroup "rlbench-sandbox-<uid>" (mkdir is atomic:
    runs that share the cgroup tree, whatever their PID namespaces, never share a uid; processes without a cgroup in
    common collide with a probability of about (runs alive)**2 / 2**31)."""
    while True:
        uid = UID_BASE + secrets.randbelow(UID_RANGE)
        with _uids_lock:
            if uid in _uids_alive:
                continue
            _uids_alive.add(uid)
        cgroup = Cgroup(bases, f"{Cgroup.PREFIX}{uid}") if bases else None
        try:
            if cgroup is not None:
                cgroup.create(asdict(limits))
            break
        except FileExistsError:
            with _uids_lock:
                _uids_alive.discard(uid)
    try:
        yield uid, cgroup
    finally:
        failed = cgroup.remove() if cgroup is not None else []
        if failed:
            _log.warning("the sandbox could not remove %s", failed)
        with _uids_lock:
            _uids_alive.discard(uid)


@contextlib.contextmanager
def _private_dir(mode: str, root: bool, leftover: list):
    """"rlimits": the program's throwaway directory (removed afterwards without following links; why it could not
    be is appended to `leftover`: the program's failure). "bwrap" as root: device nodes owned by nobody (the run
    maps root, so the host's own /dev/null would be its file to chmod). Else None."""
    if mode == "rlimits" or (mode == "bwrap" and root):
        path = tempfile.mkdtemp(prefix="rlbench-sandbox-" if mode == "rlimits" else "rlbench-sandbox-dev-")
    else:
        yield None
        return
    try:
        if mode == "bwrap":
            for device in DEVICES:
                node = os.path.join(path, device)
                os.mknod(node, 0o666 | stat.S_IFCHR, os.stat(f"/dev/{device}").st_rdev)
                os.chmod(node, 0o666)
                os.chown(node, NOBODY, NOBODY)
        yield path
    finally:
        leftover += [why for why in [_remove(path)] if why]


DEVICES = ("null", "zero", "random", "urandom")
NOBODY = 65534


def _launch(spec: dict, stdin: str, limits: Limits, cgroup: Cgroup | None, devices: str | None):
    """Start the jail (in bubblewrap in "bwrap" mode), wait for it; (returncode, timed out, its report, stdout,
    stderr, wall seconds). Every file the run gets is a memfd: stdin sealed, stdout and stderr bounded by
    RLIMIT_FSIZE (fallocate included), none on the host's disk."""
    bwrap = spec["mode"] == "bwrap"
    opened = set()  # closed once each: a number closed twice may be another thread's file by then

    def fd(pair_or_fd):
        opened.update(pair_or_fd if isinstance(pair_or_fd, tuple) else (pair_or_fd,))
        return pair_or_fd

    def close(*fds):
        for each in opened.intersection(fds):
            opened.discard(each)
            os.close(each)

    try:
        fin = fd(_memfd("stdin", stdin.encode(), seal=True))
        fout, ferr = fd(_memfd("stdout")), fd(_memfd("stderr"))
        fspec = fd(_memfd("spec", marshal.dumps(spec), seal=True))
        status_read, status_write = fd(os.pipe())
        argv = [_interpreter(), "-I", "-S", "-B", BWRAP_JAIL if bwrap else str(JAIL), str(fspec), str(status_write)]
        fds = [fspec, status_write]
        if bwrap:
            fseccomp = fd(_memfd("seccomp", seccomp_filter(os.uname().machine), seal=True))
            (bwrap_read, bwrap_write), (block_read, block_write) = fd(os.pipe()), fd(os.pipe())
            fds += [fseccomp, bwrap_write, block_read]
            argv = _bwrap_argv(spec["limits"], fseccomp, bwrap_write, block_read, devices) + argv
        start = time.monotonic()
        process = subprocess.Popen(argv, cwd="/", env={"LANG": "C.UTF-8"}, stdin=fin, stdout=fout, stderr=ferr,
                                   pass_fds=fds, start_new_session=True)
        close(status_write, *([bwrap_write, block_read] if bwrap else []))
        init = None
        # "namespaces": the launcher keeps the wall clock (this is in case it is stuck); else the parent does
        grace = 10.0 if spec["mode"] == "namespaces" else 0.0
        try:
            if bwrap:  # the run's PID 1 (the jail), blocked until it is in the run's cgroup
                found = _bwrap_init(bwrap_read)
                init = found and found[0]
                if cgroup is not None and found:
                    cgroup.join(found[1])
                close(block_write)
            timed_out = not _wait(process, limits.wall_s + grace)
        finally:
            if init is not None:  # first the run's PID 1, which bubblewrap then reaps
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(init, signal.SIGKILL)
                _wait(process, 10.0)
                _close(init)
            try:  # the launcher's group: the init dies with it (PDEATHSIG), and the namespace with the init
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        wall_s = time.monotonic() - start
        report = {}
        with open(os.dup(status_read), "rb") as status:
            for line in status.read().decode(errors="replace").splitlines():
                report.update(ast.literal_eval(line))
        out, err = _read(fout, limits.output_bytes), _read(ferr, limits.output_bytes)
    finally:
        close(*opened)
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


def _memfd(name: str, data: bytes = b"", seal: bool = False) -> int:
    """An unnamed in-memory file holding `data`, at offset 0; `seal`: nobody can write, grow or shrink it."""
    fd = os.memfd_create(f"rlbench-sandbox-{name}", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seal else 0))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)
    return fd


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


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


def _bwrap_argv(limits: dict, seccomp_fd: int, status_fd: int, block_fd: int, devices: str | None) -> list[str]:
    """bubblewrap's arguments: the jail is PID 1 of the run (`--as-pid-1`: bubblewrap reaps it), blocked on
    `block_fd` until the parent has put it in the run's cgroup; `devices`: a folder of device nodes to bind
    instead of the host's (as root)."""
    argv = [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--as-pid-1", "--hostname", "sandbox", "--uid", "1000", "--gid", "1000", "--cap-drop",
            "ALL"]
    for path in _read_only_paths():
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for device in DEVICES:
        argv += ["--dev-bind", os.path.join(devices or "/dev", device), f"/dev/{device}"]
    return argv + ["--ro-bind", str(JAIL), BWRAP_JAIL, "--perms", "0700", "--size",
                   str(limits["disk_mb"] << 20), "--tmpfs", "/work", "--chdir", "/work", "--seccomp", str(seccomp_fd),
                   "--json-status-fd", str(status_fd), "--block-fd", str(block_fd), "--"]


def _bwrap_init(status_fd: int) -> tuple[int, int] | None:
    """(a pidfd of the run's PID 1, its pid) from the first line bwrap writes; None if it is gone."""
    with open(status_fd, "rb", closefd=False) as f:
        line = f.readline() if select.select([f], [], [], 30.0)[0] else b""
    try:
        pid = json.loads(line)["child-pid"]
        return os.pidfd_open(pid), pid
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


def _read(fd: int, limit: int) -> str:
    return os.pread(fd, limit, 0).decode("utf-8", errors="replace")


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
        except OSError:
            continue
        removed = Cgroup.remove_stale(bases)
        if removed:
            _log.info("removed %d cgroups of sandbox runs whose parent had died: %s", len(removed), removed)
        return kind, bases
    return None, None


def _unreadable_by_others() -> str | None:
    """The first path of the interpreter and its standard library that another uid could not read, or None."""
    for path in (_interpreter(), os.path.dirname(os.__file__), str(JAIL)):
        path = os.path.realpath(path)
        while True:
            try:
                mode = os.stat(path).st_mode
            except OSError:
                return path
            if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) or path == _interpreter()) and not mode & stat.S_IXOTH:
                return path
            if path == "/":
                break
            path = os.path.dirname(path)
    return None
