"""Running an untrusted Python program: a fresh process per run, with limits, in a throwaway directory.

    run = run_python("print(input()[::-1])", stdin="abc\\n")
    run.status, run.stdout     # ("ok", "cba\\n")

What a run gets, in layers (`Run.isolation` says which were in force):

1. A new process: the interpreter in isolated mode (`python -I -S -B`: no site-packages, no user
   environment variables), an environment of PATH, HOME and TMPDIR only (HOME and TMPDIR are the run's
   own fresh temporary directory, also its working directory, deleted afterwards), its own process group.
2. Kernel resource limits (setrlimit): CPU seconds, address space (memory), the size of any file it
   writes, stdout and stderr included (output), open files, no core dumps; and a wall-clock limit
   enforced by the parent, which kills the whole process group.
3. When the parent is root: the program runs as `nobody`, so the kernel's permissions keep it out of
   private files (e.g. root's home with ~/.ssh) and the process-count limit (RLIMIT_NPROC, which the kernel
   does not apply to root) caps forks and threads. This needs an interpreter that `nobody` can read:
   the parent's own, else /usr/bin/python3; without one the program runs as the parent's user.
4. A network namespace of its own (unshare(CLONE_NEWNET); for a non-root user inside a new user
   namespace) where the kernel allows it: no interface but a loopback that is down.
5. An audit hook (`sys.addaudithook`) installed before the program starts, that ends the process (exit
   code 125, "sandbox: blocked ..." on stderr) at the first attempt to: create or use a socket; fork,
   exec, spawn a process or send a signal; load ctypes; open for writing, create, remove, rename or chmod
   anything outside its directory; open for reading or list anything outside its directory and the
   interpreter's standard library.

Limits, honestly: the audit hook is a tripwire, not a boundary. CPython's documentation says audit
hooks are not a sandbox: a determined program can reach the hook's state through introspection (gc,
frames) or memory corruption, and C code that does not raise audit events (stat, readlink) still sees
which paths exist. The boundaries the kernel enforces are layers 1-4: rlimits always; the `nobody` user
and the network namespace only where the machine allows them (both hold on the project's machines, as
root). There is no seccomp filter, no chroot and no mount namespace: running as `nobody`, the program
could read world-readable files if it got around the hook. Use a container or a VM for hostile code.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCKED_EXIT = 125
"""Exit code of a program the audit hook stopped."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    """CPU seconds (RLIMIT_CPU); past it the kernel sends SIGXCPU."""
    wall_s: float = 5.0
    """Wall-clock seconds, counted by the parent, which then kills the process group."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS): a larger allocation raises MemoryError."""
    processes: int = 8
    """Processes and threads of the sandbox user (RLIMIT_NPROC); only when running as `nobody`."""
    output_bytes: int = 1 << 20
    """Largest stdout, stderr or written file (RLIMIT_FSIZE); a write past it fails (EFBIG, "output_limit")."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""


@dataclass(frozen=True)
class Run:
    status: str
    """"ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock), "cpu_time", "memory", "output_limit",
    "blocked" (the audit hook stopped it), or "killed" (another signal)."""
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: dict = field(default_factory=dict)
    """Which layers applied: {"user": "nobody" | "root" | ..., "network_namespace": bool, "audit_hook": True}."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def reason(self) -> str:
        """One line on why it did not succeed ("" when it did)."""
        if self.ok:
            return ""
        last = self.stderr.strip().splitlines()[-1:] or [""]
        return f"{self.status} (exit code {self.returncode}): {last[0][:300]}"


def run_python(code: str, *, stdin: str = "", files: dict[str, str] | None = None,
               limits: Limits = Limits()) -> Run:
    """Run `code` as a program (`__name__ == "__main__"`) in a sandbox; `files` are written to its directory."""
    with tempfile.TemporaryDirectory(prefix="rlbench-sandbox-") as tmp:
        work, control = Path(tmp) / "work", Path(tmp) / "control"
        work.mkdir()
        control.mkdir(mode=0o700)
        for name, text in {"main.py": code, **(files or {})}.items():
            (work / name).write_text(text)
        (control / "stdin").write_text(stdin)
        user = _sandbox_user()
        if user is not None:
            os.chmod(tmp, 0o711)  # nobody may pass through to work/, not list or enter control/
            for path in [work, *work.rglob("*")]:
                os.chown(path, *user)
        spec = dict(limits.__dict__, user=user, work=str(work), facts=str(control / "facts.json"))
        start = time.monotonic()
        returncode, timed_out = _execute(spec, control, limits.wall_s)
        wall_s = time.monotonic() - start
        stdout, stderr = (_read(control / name, limits.output_bytes) for name in ("stdout", "stderr"))
        facts = json.loads((control / "facts.json").read_text()) if (control / "facts.json").exists() else {}
    return Run(_status(returncode, timed_out, stderr), returncode, stdout, stderr, wall_s, facts)


def _execute(spec: dict, control: Path, wall_s: float) -> tuple[int, bool]:
    env = {"PATH": "/usr/bin:/bin", "HOME": spec["work"], "TMPDIR": spec["work"], "LANG": "C.UTF-8"}
    argv = [_interpreter(spec["user"] is not None), "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(spec)]
    with open(control / "stdin") as fin, open(control / "stdout", "w") as fout, open(control / "stderr", "w") as ferr:
        process = subprocess.Popen(argv, cwd=spec["work"], env=env, stdin=fin, stdout=fout, stderr=ferr,
                                   start_new_session=True, close_fds=True)
        try:
            process.wait(timeout=wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the whole group: whatever it started goes too
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return process.returncode, timed_out


def _status(returncode: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == BLOCKED_EXIT and "sandbox: blocked" in stderr:
        return "blocked"
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:  # CPython ignores SIGXFSZ: EFBIG
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if returncode < 0 else "error"


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _sandbox_user() -> tuple[int, int] | None:
    """(uid, gid) of `nobody` when we are root and it can run an interpreter, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return (nobody.pw_uid, nobody.pw_gid) if _interpreter(True, required=False) else None


def _interpreter(for_nobody: bool, required: bool = True) -> str | None:
    """This interpreter, or (for `nobody`) the first of it and /usr/bin/python3 that `nobody` can start."""
    ours = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not for_nobody:
        return ours
    for candidate in (ours, shutil.which("python3", path="/usr/bin:/bin")):
        if candidate and _nobody_can_run(candidate):
            return candidate
    if required:
        raise RuntimeError("no Python interpreter that the user nobody can run")
    return None


@functools.cache
def _nobody_can_run(executable: str) -> bool:
    nobody = pwd.getpwnam("nobody")
    try:
        done = subprocess.run([executable, "-I", "-S", "-B", "-c", "import json, resource"], cwd="/",
                              user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], env={},
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


# The child's first code: limits, namespace, user, audit hook, then the program. It must run on any
# Python >= 3.8 (the interpreter may be the system's) and import nothing the program could not.
_BOOTSTRAP = r'''
def _start():
    import json, os, resource, sys
    spec = json.loads(sys.argv[1])
    facts = {"audit_hook": True, "network_namespace": False}
    try:
        import ctypes
        flags = 0x40000000 if os.geteuid() == 0 else 0x40000000 | 0x10000000  # CLONE_NEWNET (| CLONE_NEWUSER)
        facts["network_namespace"] = ctypes.CDLL(None, use_errno=True).unshare(flags) == 0
    except Exception:
        pass
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    R = resource
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    R.setrlimit(R.RLIMIT_AS, (spec["memory_mb"] << 20, spec["memory_mb"] << 20))
    R.setrlimit(R.RLIMIT_FSIZE, (spec["output_bytes"], spec["output_bytes"]))
    R.setrlimit(R.RLIMIT_NOFILE, (spec["open_files"], spec["open_files"]))
    facts["user"] = "nobody" if spec["user"] else str(os.geteuid())
    with open(spec["facts"], "w") as f:
        json.dump(facts, f)
    if spec["user"]:
        os.setgroups([])
        os.setgid(spec["user"][1])
        os.setuid(spec["user"][0])
        R.setrlimit(R.RLIMIT_NPROC, (spec["processes"], spec["processes"]))
    os.chdir(spec["work"])
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    readable = tuple(os.path.realpath(p) for p in sys.path if p and os.path.exists(p))
    sys.addaudithook(_make_hook(os.path.realpath(spec["work"]), readable))
    sys.argv = ["main.py"]
    return code


def _make_hook(work, readable):
    import os
    deny_prefixes = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
                     "os.killpg", "subprocess.", "pty.", "signal.pthread_kill", "socket.", "ctypes.",
                     "_posixsubprocess")
    deny_imports = ("ctypes", "_ctypes", "_posixsubprocess")
    write_events = ("os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                    "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lockf", "os.setxattr",
                    "os.removexattr", "shutil.")
    read_events = ("os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr", "glob.glob")
    writing_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode, write, exit_now = os.path.realpath, os.fsdecode, os.write, os._exit

    def deny(what):
        write(2, ("\nsandbox: blocked " + what + "\n").encode("utf-8", "replace"))
        exit_now(125)

    def check_paths(event, args, roots):
        for arg in args:
            if isinstance(arg, (str, bytes)) or hasattr(arg, "__fspath__"):
                real = realpath(fsdecode(arg))
                if not any(real == root or real.startswith(root + "/") for root in roots):
                    deny("%s(%r)" % (event, arg))

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            if isinstance(path, int):
                return
            writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & writing_flags)
            check_paths("open", [path], (work,) if writing else (work,) + readable)
        elif event == "import":
            if args[0] in deny_imports or args[0].startswith("ctypes."):
                deny("import " + args[0])
        elif event.startswith(deny_prefixes):
            deny(event)
        elif event.startswith(write_events):
            check_paths(event, args, (work,))
        elif event.startswith(read_events):
            check_paths(event, args, (work,) + readable)
    return hook


_code = _start()
del _start, _make_hook
__file__ = "main.py"
exec(_code)
'''
