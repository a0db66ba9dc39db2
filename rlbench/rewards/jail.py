"""The child side of the code sandbox: `python -I -S -B jail.py SPEC_FD STATUS_FD`, started by `sandbox.run_python`.

Standard library only (it runs isolated, without site-packages) and never imported by rlbench: it is a script.
It reads the run's spec (a marshalled dict) from SPEC_FD, reports on STATUS_FD (lines, each a dict's repr), and
runs the program with its stdin, stdout and stderr on fds 0-2, which the parent opened on memfds.

In "namespaces" mode (root) three processes make a run:

    launcher  host namespaces and the parent's cgroup (nothing the run can exhaust): unshares, forks the init,
              enforces the wall clock (SIGKILL to the init), reports the cgroup's counters
    init      PID 1 of the run's PID namespace, root inside its own mount, network, IPC and UTS namespaces:
              joins the run's cgroup (which the parent made and removes), builds the run's root (a size-limited
              tmpfs, read-only binds of what Python needs, read-only devices, the program's files), pivots into
              it, forks the program, reaps, reports the program's exit status. When it exits the kernel kills
              every process left in the namespace.
    program   drops to the run's own uid (one per concurrent run), rlimits, no_new_privs, a seccomp filter,
              the audit hook, then runs main.py, the check code and the check token.

In "bwrap" mode (not root, bubblewrap installed) bubblewrap makes the namespaces (user, PID, mount, network, IPC,
UTS), the tmpfs at /work, drops capabilities, sets no_new_privs and loads the seccomp filter built here; this
script is the run's PID 1 (held until the parent has put it in the run's cgroup, as root): it writes the files,
forks the program, reaps and reports its exit status.

In "rlimits" mode (neither) the launcher is the program: rlimits, a network namespace where the kernel lets
an unprivileged user make one, the audit hook; as root, first the run's own uid, which owns only its directory.
"""

import ctypes
import errno
import fcntl
import marshal
import os
import resource
import select
import signal
import struct
import sys
import time

# ------------------------------------------------------------------------------------------------ the kernel
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP, CLONE_NEWTIME = 0x02000000, 0x00000080
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2

# Syscalls the program never needs (from the kernel's uapi headers). Denied with EPERM; a foreign ABI kills.
DENIED = ("ptrace mount umount2 pivot_root chroot unshare setns keyctl add_key request_key bpf perf_event_open "
          "kexec_load kexec_file_load init_module finit_module delete_module reboot swapon swapoff "
          "process_vm_readv process_vm_writev userfaultfd open_by_handle_at name_to_handle_at acct quotactl "
          "settimeofday clock_settime clock_adjtime adjtimex syslog kcmp fanotify_init lookup_dcookie personality "
          "vhangup sethostname setdomainname pidfd_getfd io_uring_setup io_uring_enter io_uring_register "
          "open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr iopl ioperm uselib nfsservctl "
          "io_setup io_submit").split()  # (the kernel's asynchronous I/O contexts are counted host-wide: aio-nr)
SOCKETS = ("socket", "socketpair")
"""Allowed for AF_UNIX only (inside the run's own namespaces); every other family fails with EAFNOSUPPORT."""
SYSCALLS = {  # machine -> (AUDIT_ARCH_*, {name: number}); names missing on an architecture do not exist there
    "x86_64": (0xC000003E, dict(zip(
        DENIED + ["clone", "clone3", *SOCKETS],
        [101, 165, 166, 155, 161, 272, 308, 250, 248, 249, 321, 298, 246, 320, 175, 313, 176, 169, 167, 168, 310,
         311, 323, 304, 303, 163, 179, 164, 227, 305, 159, 103, 312, 300, 212, 135, 153, 170, 171, 438, 425, 426,
         427, 428, 429, 430, 431, 432, 433, 442, 172, 173, 134, 180, 206, 209, 56, 435, 41, 53]))),
    "aarch64": (0xC00000B7, dict(zip(
        [n for n in DENIED if n not in ("iopl", "ioperm", "uselib")] + ["clone", "clone3", *SOCKETS],
        [117, 40, 39, 41, 51, 97, 268, 219, 217, 218, 280, 241, 104, 294, 105, 273, 106, 142, 224, 225, 270, 271,
         282, 265, 264, 89, 60, 170, 112, 266, 171, 116, 272, 262, 18, 92, 58, 161, 162, 438, 425, 426, 427, 428,
         429, 430, 431, 432, 433, 442, 42, 0, 2, 220, 435, 198, 199]))),
}
NEW_NAMESPACES = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                  | CLONE_NEWCGROUP | CLONE_NEWTIME)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _bytes(path):
    return None if path is None else os.fsencode(path)


def mount(source, target, fstype, flags, data=None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)),
           f"mount {source} on {target}")


def prctl(option: int, arg: int, pointer=None) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), pointer, 0, 0), f"prctl({option})")


def seccomp_filter(machine: str) -> bytes:
    """A classic-BPF program: other ABIs are killed; DENIED syscalls and clone() with a namespace flag fail with
    EPERM; clone3 fails with ENOSYS (its flags sit behind a pointer, so libc falls back to clone); a socket of
    another family than AF_UNIX fails with EAFNOSUPPORT; the rest run."""
    audit_arch, numbers = SYSCALLS[machine]
    EPERM, ENOSYS, EAFNOSUPPORT, AF_UNIX = 1, 38, 97, 1
    ALLOW, ERRNO, KILL = 0x7FFF0000, 0x00050000, 0x80000000

    def load(offset):
        return struct.pack("HBBI", 0x20, 0, 0, offset)  # BPF_LD | BPF_W | BPF_ABS

    def jump(op, k, true, false):
        return struct.pack("HBBI", op, true, false, k)  # 0x15 JEQ, 0x35 JGE, 0x45 JSET (BPF_JMP | BPF_K)

    def ret(value):
        return struct.pack("HBBI", 0x06, 0, 0, value)

    program = [load(4), jump(0x15, audit_arch, 1, 0), ret(KILL), load(0)]
    if machine == "x86_64":  # the x32 ABI shares the architecture and sets bit 30 of the number
        program += [jump(0x35, 0x40000000, 0, 1), ret(ERRNO | EPERM)]
    for name in DENIED:
        if name in numbers:
            program += [jump(0x15, numbers[name], 0, 1), ret(ERRNO | EPERM)]
    for name in SOCKETS:  # the family is the low 32 bits of the first argument
        program += [jump(0x15, numbers[name], 0, 4), load(16), jump(0x15, AF_UNIX, 0, 1), ret(ALLOW),
                    ret(ERRNO | EAFNOSUPPORT)]
    program += [jump(0x15, numbers["clone3"], 0, 1), ret(ERRNO | ENOSYS),
                jump(0x15, numbers["clone"], 0, 3), load(16),  # the low 32 bits of clone's first argument, flags
                jump(0x45, NEW_NAMESPACES, 0, 1), ret(ERRNO | EPERM), ret(ALLOW)]
    return b"".join(program)


def install_seccomp(machine: str) -> None:
    code = seccomp_filter(machine)
    buffer = ctypes.create_string_buffer(code, len(code))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = Program(len(code) // 8, ctypes.addressof(buffer))
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program))


# ---------------------------------------------------------------------------------------------- the cgroup
class Cgroup:
    """A run's cgroup, `name` (unique among the runs alive: "rlbench-sandbox-<the run's uid>") under the parent's
    own: one directory per controller (v1) or one directory (v2). The parent makes it (`create`, holding a lock on
    it for the run), the run's first process joins it (`join`: the launcher stays outside, so the run's processes
    can exhaust nothing it needs), and the parent removes it (`remove`), also after a launcher that was killed;
    `remove_stale` clears those of parents that died."""

    PREFIX = "rlbench-sandbox-"
    STALE_S = 60.0
    """A directory this old whose lock is free belongs to a parent that died (the lock is taken right after mkdir)."""

    def __init__(self, bases: dict, name: str):
        self.bases, self.name = bases, name
        self.dirs = {controller: os.path.join(base, name) for controller, base in bases.items()}
        self.locks = []

    def create(self, limits: dict) -> None:
        """Make it with the run's limits (a whole run may hold memory_mb plus its tmpfs, and one CPU; v2: an OOM
        kills the whole run); FileExistsError if a live run has the name."""
        memory, processes = str((limits["memory_mb"] + limits["disk_mb"]) << 20), str(limits["processes"] + 1)  # (+ its init)
        values = {  # controller ("" for v2) -> (file, value)
            "": [("pids.max", processes), ("memory.max", memory), ("memory.swap.max", "0"), ("cpu.max", "100000"),
                 ("memory.oom.group", "1")],
            "pids": [("pids.max", processes)],
            "memory": [("memory.limit_in_bytes", memory)],
            "cpu": [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "100000")],
        }
        try:
            for controller, path in self.dirs.items():
                os.mkdir(path, 0o700)
                self.locks.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
                fcntl.flock(self.locks[-1], fcntl.LOCK_EX)
                for name, value in values[controller]:
                    if os.path.exists(os.path.join(path, name)):
                        with open(os.path.join(path, name), "w") as f:
                            f.write(value)
        except BaseException:
            self.remove()
            raise

    def join(self, pid: int = 0) -> None:
        """Move process `pid` (0: this one) into it; its children follow."""
        for path in self.dirs.values():
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def counters(self) -> dict:
        """How often the run met its memory and process limits."""
        out = {}
        for path in self.dirs.values():
            for name in ("memory.events", "memory.oom_control", "pids.events"):
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name)) as f:
                        for line in f:
                            key, _, value = line.partition(" ")
                            if key in ("oom_kill", "max"):
                                out["oom_kills" if key == "oom_kill" else "pids_max_hits"] = int(value)
        return out

    def remove(self, wait_s: float = 5.0) -> list[str]:
        """Remove it once its processes are gone (a killed run's may take a moment); what could not be removed."""
        failed, deadline = [], time.monotonic() + wait_s
        for path in self.dirs.values():
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        failed.append(f"{path}: {e}")
                        break
                    time.sleep(0.01)
        for lock in self.locks:
            os.close(lock)
        self.locks = []
        return failed

    @classmethod
    def remove_stale(cls, bases: dict, older_than_s: float = STALE_S) -> list[str]:
        """Remove the cgroups whose parent died (their lock is free, made over `older_than_s` ago); their paths."""
        removed = []
        for base in bases.values():
            for name in os.listdir(base):
                path = os.path.join(base, name)
                if not name.startswith(cls.PREFIX) or not os.path.isdir(path):
                    continue
                try:
                    lock = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                except OSError:
                    continue
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if time.time() - os.fstat(lock).st_ctime > older_than_s:
                        os.rmdir(path)
                        removed.append(path)
                except OSError:
                    pass  # held (a live run) or not empty (a dead parent's run still ending)
                finally:
                    os.close(lock)
        return removed


# ----------------------------------------------------------------------------------------- the run's world
def build_root(spec: dict) -> None:
    """In the init's own mount namespace: a tmpfs as the new root with read-only binds of what Python needs,
    /dev/{null,zero,random,urandom} (read-only mounts: writing to a device works, changing its inode does not),
    /work (the program's, on the tmpfs) holding its files; then pivot into it."""
    limits, uid = spec["limits"], spec["uid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    # mounted over only inside this namespace: a directory no bound path lies under (a Python under /tmp stays)
    root = next(d for d in ("/tmp", "/mnt", "/srv", "/media", "/run") if os.path.isdir(d) and
                not any(path == d or path.startswith(d + "/") for path in spec["read_only"]))
    mount("rlbench-sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={limits['disk_mb']}m,nr_inodes={limits['disk_inodes']},mode=755")
    for path in spec["read_only"]:
        if not os.path.lexists(path):
            continue
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems: the same link
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            open(target, "w").close()
        mount(path, target, None, MS_BIND | MS_REC)
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/dev")
    for device in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{device}", "w").close()
        mount(f"/dev/{device}", f"{root}/dev/{device}", None, MS_BIND)
        mount(None, f"{root}/dev/{device}", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    work = root + "/work"
    os.mkdir(work, 0o700)
    os.chown(work, uid, uid)  # a fresh tmpfs only this process has seen: nothing can race it
    write_files(work, spec["files"], uid)
    os.chdir(root)
    _check(_libc.syscall(155 if spec["machine"] == "x86_64" else 41, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    name = b"sandbox"
    _check(_libc.sethostname(name, len(name)), "sethostname")


def write_files(work: str, files: dict, uid: int | None = None) -> None:
    """The program's files into its fresh directory; files that do not fit its disk are the program's failure."""
    for name, text in files.items():
        try:
            with open(os.open(f"{work}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
                f.write(text)
                if uid is not None:
                    os.fchown(f.fileno(), uid, uid)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ProgramError(f"the program's files do not fit its disk (disk_mb, disk_inodes): {name}: "
                               f"{e.strerror}") from None


class ProgramError(Exception):
    """Why the program cannot run that is the program's own doing (reported as its failure, not the sandbox's)."""


def set_rlimits(limits: dict, *, processes: bool = False) -> None:
    """The per-process limits; with `processes`, RLIMIT_NPROC too (it counts the processes of the real uid)."""
    R = resource
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    R.setrlimit(R.RLIMIT_AS, (limits["memory_mb"] << 20, limits["memory_mb"] << 20))
    R.setrlimit(R.RLIMIT_FSIZE, (limits["output_bytes"], limits["output_bytes"]))
    R.setrlimit(R.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    if processes:
        R.setrlimit(R.RLIMIT_NPROC, (limits["processes"], limits["processes"]))


def become_program(spec: dict) -> None:
    """The program's process, still root inside the run's namespaces: its own uid, limits, no way back."""
    uid = spec["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    set_rlimits(spec["limits"], processes=True)  # RLIMIT_NPROC counts the run's uid: this run's processes alone
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    install_seccomp(spec["machine"])
    os.chdir("/work")


def launch(spec: dict, status) -> None:
    """The launcher's part in "namespaces" mode: returns in the program's process only. The launcher stays outside
    the run's PID namespace and cgroup (the parent made the cgroup; the init joins it)."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the children: the launcher stays outside
    init = os.fork()
    if init == 0:
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if spec["cgroup"]:
                Cgroup(spec["cgroup"], spec["cgroup_name"]).join()
            _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
            build_root(spec)
            program = os.fork()
        except ProgramError as e:
            report(status, {"refused": str(e)})
            os._exit(0)
        except BaseException as e:
            report(status, {"error": f"the sandbox's init failed: {type(e).__name__}: {e}"})
            os._exit(0)
        if program == 0:
            become_program(spec)  # its failure is reported by prepare()
            return
        try:
            report_exit(status, reap(program))
        finally:
            os._exit(0)  # the kernel kills whatever the program left in the namespace
    ready, _, _ = select.select([os.pidfd_open(init)], [], [], spec["limits"]["wall_s"])
    if not ready:
        os.kill(init, signal.SIGKILL)
    os.waitpid(init, 0)  # returns once every process of the namespace is gone
    report(status, {"timeout": not ready})
    os._exit(0)


def report(status, facts: dict) -> None:
    status.write(repr(facts) + "\n")
    status.flush()


def reap(program: int) -> int:
    """As PID 1 of the run: reap every orphan until the program ends; its wait status."""
    while True:
        pid, wait_status = os.waitpid(-1, 0)
        if pid == program:
            return wait_status


def report_exit(status, wait_status: int) -> None:
    if os.WIFSIGNALED(wait_status):
        report(status, {"signal": os.WTERMSIG(wait_status)})
    else:
        report(status, {"exit": os.WEXITSTATUS(wait_status)})


def supervise(spec: dict, status) -> None:
    """"bwrap" mode: bwrap made the namespaces, dropped every capability, set no_new_privs and loaded the seccomp
    filter, and (as root) the parent put this process in the run's cgroup. This process is PID 1 of the run
    (`--as-pid-1`, so that bubblewrap reaps it): it writes the program's files into /work (bwrap's tmpfs), forks
    the program, reaps every orphan and reports how the program ended; its exit ends the namespace."""
    try:
        write_files("/work", spec["files"])
    except ProgramError as e:
        report(status, {"refused": str(e)})
        os._exit(0)
    program = os.fork()
    if program == 0:
        set_rlimits(spec["limits"], processes=True)
        os.chdir("/work")
        return
    report_exit(status, reap(program))
    os._exit(0)


def weak_isolation(spec: dict, status) -> None:
    """The program in this process: rlimits, a network namespace where the kernel allows one, and as root the
    run's own uid (which owns only the program's directory; the parent checked that it can read the interpreter)."""
    root = os.geteuid() == 0
    network = hasattr(_libc, "unshare") and _libc.unshare(CLONE_NEWNET if root else CLONE_NEWNET | CLONE_NEWUSER) == 0
    uid = spec["uid"] if root else os.geteuid()
    report(status, {"network_namespace": network, "uid": uid})
    os.chdir(spec["work"])
    if root:
        os.chown(".", uid, uid)
        for name in spec["files"]:
            os.chown(name, uid, uid, follow_symlinks=False)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    set_rlimits(spec["limits"], processes=root)  # RLIMIT_NPROC counts the uid's processes: a per-run cap as root


# ------------------------------------------------------------------------------------------ the tripwire
def audit_hook(work: str, readable: tuple):
    """An extra tripwire, not the boundary: the first socket, process, signal, ctypes, gc introspection (the
    route to this hook) or file operation outside the program's directory ends the run (exit 125, "sandbox:
    blocked ...") with a message a model can read."""
    deny_prefixes = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
                     "os.killpg", "subprocess.", "pty.", "signal.pthread_kill", "socket.", "ctypes.",
                     "_posixsubprocess", "gc.get_")
    deny_imports = ("ctypes", "_ctypes", "_posixsubprocess")
    write_events = ("os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                    "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lockf", "os.setxattr",
                    "os.removexattr", "shutil.")
    read_events = ("os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr", "glob.glob")
    writing_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode, write, exit_now, is_instance = os.path.realpath, os.fsdecode, os.write, os._exit, isinstance
    text_types = (str, bytes)

    def deny(what):
        write(2, ("\nsandbox: blocked " + what + "\n").encode("utf-8", "replace"))
        exit_now(125)

    def check_paths(event, args, roots):
        for arg in args:
            if is_instance(arg, text_types) or hasattr(arg, "__fspath__"):
                real = realpath(fsdecode(arg))
                for root in roots:
                    if real == root or real.startswith(root + "/"):
                        break
                else:
                    deny("%s(%r)" % (event, arg))

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            if is_instance(path, int):
                return
            writing = bool((flags or 0) & writing_flags) or (mode is not None and (
                "w" in mode or "a" in mode or "x" in mode or "+" in mode))
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


# ------------------------------------------------------------------------------------------------- a run
def prepare():
    """Everything before the program, in the process that will run it: (main.py's source, the check's code, token)."""
    spec_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(spec_fd, "rb", closefd=False) as f:
        spec = marshal.load(f)
    status = os.fdopen(status_fd, "w")
    spec["machine"] = os.uname().machine
    try:
        os.close(spec_fd)
        if spec["mode"] == "namespaces":
            launch(spec, status)  # only the program's process comes back
        elif spec["mode"] == "bwrap":
            supervise(spec, status)  # likewise
        else:
            weak_isolation(spec, status)
        work = os.getcwd()
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"})
        os.umask(0o077)
        with open("main.py", "rb") as f:  # compiled by main(): a syntax error is the program's, not the sandbox's
            source = f.read()
        check = compile(spec["check"], "<tests>", "exec") if spec["check"] is not None else None
    except BaseException as e:
        if not status.closed:
            report(status, {"error": f"the sandbox could not start: {type(e).__name__}: {e}"})
        os._exit(126)
    status.close()
    os.closerange(3, 1 << 16)  # nothing of the launcher's stays open in the program
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    if spec["mode"] != "rlimits":  # all it can see is the system's read-only files: reading is not the risk
        readable = ("",)
    else:  # the standard library, and this file (the interpreter's traceback printer reads its lines)
        readable = tuple(os.path.realpath(p) for p in sys.path + [__file__] if p and os.path.exists(p))
    if spec["tripwire"]:
        sys.addaudithook(audit_hook(os.path.realpath(work), readable))
    sys.argv = ["main.py"]
    return source, check, spec["token"]


def main():
    """Run main.py as __main__, then the check code in its namespace, then print the token: a program that
    exits early (sys.exit, os._exit, a signal) never prints it. Exceptions reach the interpreter's own
    handler, which prints the traceback and exits 1.

    The check runs through this frame's own `exec` (a program that replaces builtins.exec or the module's globals
    does not skip it). The token is a local of this frame, so a program that walks the stack (sys._getframe, a
    traceback's frames) can read and print it: the token defeats early exits, which policies find, not a program
    written to attack this harness. `code_reward` therefore sends call tests' inputs only and compares their values
    on the host; only assertions of other forms rely on the token."""
    source, check, token = prepare()
    run, write = exec, sys.stdout.write  # the program may replace builtins.exec or sys.stdout: not for the check
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    run(compile(source, "main.py", "exec"), namespace)
    if check is not None:
        run(check, namespace)
        write("\n" + token + "\n")


if __name__ == "__main__":
    main()
