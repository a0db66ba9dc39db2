"""The code sandbox: hostile programs end in a recorded failure within their limits; nothing outside their run
changes and nothing of them is left running.

The attacks of the sandbox issue (#22) run in the strongest mode this machine allows (`sandbox_info()`, printed in
pytest's header): as root, "namespaces". Most run with `tripwire=False`, i.e. as a program that already got
around the audit hook would: what stops them there is the kernel.
"""

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

import rlbench
from rlbench.rewards import Limits, SandboxError, code_reward, extract_code, run_python, sandbox_info, score_all
from rlbench.rewards import code, sandbox

PROJECT_FILE = Path(rlbench.__file__).resolve().parents[1] / "pyproject.toml"
FAST = Limits(cpu_s=2, wall_s=4.0, memory_mb=256, output_bytes=1 << 20)
MODE = sandbox_info()["mode"]
KERNEL_MODES = [m for m in ("namespaces", "bwrap") if m in sandbox_info()["available"]]
each_kernel_mode = pytest.mark.parametrize("mode", KERNEL_MODES or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"no kernel isolation here, missing: {'; '.join(sandbox_info()['missing'])}"))])


def jail_processes() -> list[int]:
    """Pids of the live processes of any sandbox run (their command line names the jail), from /proc."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # it ended while we looked
        if os.fsencode(sandbox.JAIL) in args or sandbox.BWRAP_JAIL.encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


def test_a_normal_program_runs_with_stdin_and_its_own_files():
    run = run_python("import json\nprint(sum(json.load(open('data.json'))) + int(input()))", stdin="4\n",
                     files={"data.json": "[1, 2, 3]"}, limits=FAST)
    assert (run.status, run.stdout, run.returncode) == ("ok", "10\n", 0) and run.ok and run.reason == ""


def test_a_program_may_write_and_read_in_its_directory_and_threads_work():
    code = ("import threading\nopen('out.txt', 'w').write('hi')\nt = threading.Thread(target=print, args=('t',))\n"
            "t.start(); t.join()\nprint(open('out.txt').read())")
    assert run_python(code, limits=FAST).stdout == "t\nhi\n"


def test_a_crash_is_an_error_with_the_traceback():
    run = run_python("1 / 0", limits=FAST)
    assert run.status == "error" and run.returncode == 1 and "ZeroDivisionError" in run.reason
    assert 'File "main.py", line 1' in run.stderr


def test_file_names_must_be_plain():
    for name in ("../x", "a/b", "main.py", ""):
        with pytest.raises(ValueError, match="plain name"):
            run_python("pass", files={name: "x"}, limits=FAST)


def test_the_mode_and_its_guarantees_are_reported():
    info, run = sandbox_info(), run_python("pass", limits=FAST)
    assert info["mode"] in ("namespaces", "rlimits") and info["guarantees"]
    assert run.isolation["mode"] == info["mode"] and run.isolation["audit_hook"] is True
    if os.geteuid() == 0:  # the project's machines and CI: root, so the kernel's isolation
        assert info["mode"] == "namespaces" and info["seccomp"] and run.isolation["network_namespace"]
        assert run.isolation["uid"] >= sandbox.UID_BASE


def test_a_weak_mode_is_never_chosen_silently_and_warns_what_it_lacks(monkeypatch):
    weak = {"mode": "rlimits", "available": ["rlimits"], "missing": ["root (for the test)"], "why_not": {},
            "guarantees": []}
    monkeypatch.setattr(sandbox, "sandbox_info", lambda: weak)
    monkeypatch.delenv("RLBENCH_SANDBOX", raising=False)
    # the attack: on a machine without kernel isolation the "rlimits" tripwire was chosen silently
    with pytest.raises(SandboxError, match=r"no kernel isolation.*root \(for the test\).*sandbox='rlimits'"):
        run_python("print(1)", limits=FAST)
    monkeypatch.setattr(sandbox, "_run", lambda mode, *args: mode)  # (the run itself: see the rlimits tests below)
    sandbox._warn_weak.cache_clear()
    with pytest.warns(UserWarning, match=r"'rlimits' mode, which lacks: the kernel's isolation.*a cgroup per run"):
        assert run_python("print(1)", mode="rlimits") == "rlimits"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.setenv("RLBENCH_SANDBOX", "rlimits")  # how Session(sandbox="rlimits") tells its workers
        assert run_python("print(2)") == "rlimits"
    assert seen == []  # once
    with pytest.raises(SandboxError, match=r"tripwire=False needs the kernel's isolation.*lacks: root"):
        run_python("pass", tripwire=False, limits=FAST)
    monkeypatch.setenv("RLBENCH_SANDBOX", "bwrap")
    with pytest.raises(SandboxError, match=r"'bwrap' \(from \$RLBENCH_SANDBOX\) is not available here"):
        run_python("pass")
    sandbox._warn_weak.cache_clear()


def test_the_guarantees_each_mode_lacks_are_reported():
    info = sandbox_info()
    assert info["lacks"] == sandbox._lacks(info["mode"]) and set(info["why_not"]) | set(info["available"]) == {
        "namespaces", "bwrap", "rlimits"}
    if "bwrap" in info["available"]:
        assert any(line.startswith("a uid per run") for line in sandbox._lacks("bwrap"))
    lacks = sandbox._lacks("rlimits")
    assert lacks[0].startswith("the kernel's isolation") and lacks[1].startswith("a cgroup per run")


def test_with_no_working_mode_the_sandbox_says_so_at_start_up(monkeypatch):
    monkeypatch.setattr(sandbox, "_interpreter", lambda: "/nonexistent/python3")
    sandbox.sandbox_info.cache_clear()
    try:
        info = sandbox_info()
        assert info["available"] == [] and info["mode"] is None
        with pytest.raises(SandboxError, match=r"no sandbox mode works here.*/nonexistent/python3"):
            run_python("print(1)")
    finally:
        sandbox.sandbox_info.cache_clear()


# --- "rlimits" (no kernel isolation): as root the program runs as a uid of its own, or the mode is refused ----
READABLE_PYTHON = "/usr/bin/python3.11"  # a system interpreter every uid can read (this project's lies under /root)
as_root_with_a_readable_python = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(READABLE_PYTHON, os.X_OK),
    reason=f"needs root and {READABLE_PYTHON}: the uid drop of 'rlimits' mode as root")


@pytest.fixture
def readable_python(monkeypatch):
    monkeypatch.setattr(sandbox, "_interpreter", lambda: READABLE_PYTHON)


def test_rlimits_as_root_is_refused_when_no_other_uid_can_read_the_interpreter():
    if os.geteuid() != 0:
        pytest.skip("as root only")
    unreadable = sandbox._unreadable_by_others()
    if unreadable is None:
        assert "rlimits" in sandbox_info()["available"]
    else:
        assert "rlimits" not in sandbox_info()["available"] and unreadable in sandbox_info()["why_not"]["rlimits"]
        with pytest.raises(SandboxError, match=r"'rlimits' is not available here.*interpreter other users can read"):
            run_python("print(1)", mode="rlimits")


@as_root_with_a_readable_python
def test_rlimits_as_root_runs_the_program_as_a_uid_of_its_own(readable_python, tmp_path):
    # the attack: as uid 0 the program read root-only files past the tripwire (os.stat has no audit event), signalled
    # the trainer and wrote root-owned files
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "key").write_text("root's")
    code = f"""
import os
found = [os.getuid(), os.getgroups()]
for attack in (lambda: os.stat({str(secret / "key")!r}), lambda: os.stat('/root/.bashrc')):
    try:
        found.append(attack().st_size)
    except OSError as e:
        found.append(type(e).__name__)
print(found)
"""
    run = sandbox._run("rlimits", code, "", {}, FAST, None)
    assert run.ok, run.reason
    uid, groups, *attacks = eval(run.stdout)  # noqa: S307
    assert uid == run.isolation["uid"] >= sandbox.UID_BASE and groups == []
    assert attacks == ["PermissionError", "PermissionError"]
    assert sandbox._run("rlimits", "import os; os.system('ls')", "", {}, FAST, None).status == "blocked"
    assert sandbox._run("rlimits", "import time; time.sleep(60)", "", {}, Limits(wall_s=1.0), None).status == "timeout"
    assert sandbox._run("rlimits", "import os; os._exit(0)", "", {}, FAST, "assert False").status == "early_exit"


@as_root_with_a_readable_python
def test_rlimits_removes_1100_nested_directories(readable_python):
    """shutil.rmtree recurses per level and raises RecursionError past ~1000: cleanup neither raises nor leaves
    the directory behind."""
    code = "import os\nprint(os.getcwd())\nfor i in range(1100):\n    os.mkdir('d')\n    os.chdir('d')"
    run = sandbox._run("rlimits", code, "", {}, Limits(cpu_s=20, wall_s=30), None)
    assert run.ok, run.reason
    assert "rlbench-sandbox-" in run.stdout and not Path(run.stdout.strip()).exists()


# --- the tripwire: what a model reads when it reaches for a process, a socket or a file outside -----------
@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records whether anybody connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    yield server
    server.close()


TRIPPED = {
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')",
    "write outside": "open('/tmp/rlbench-sandbox-escape-{tag}.txt', 'w').write('x')",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['cat', {project!r}])",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()",
    "find the hook through gc": "import gc\nprint([o for o in gc.get_objects() if callable(o)][:3])",
}


@pytest.mark.parametrize("name", TRIPPED)
def test_the_tripwire_stops_the_obvious_attempts(name, listener):
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    code = TRIPPED[name].format(port=listener.getsockname()[1], tag=tag, project=str(PROJECT_FILE))
    run = run_python(code, limits=FAST)
    assert run.status == "blocked" and run.returncode == 125 and "sandbox: blocked" in run.reason
    assert run.stdout == "" and not Path(f"/tmp/rlbench-sandbox-escape-{tag}.txt").exists()
    with pytest.raises(socket.timeout):
        listener.accept()  # nobody connected


# --- the kernel's boundary: the attacks of issue #22, past the tripwire ------------------------------------
@each_kernel_mode
def test_the_hooks_known_bypasses_reach_nothing(mode):
    """The tripwire bypasses that escaped the old sandbox: shadowed builtins, a patched os.fspath /
    posixpath.abspath, dir_fd and O_PATH walks. Past the hook there is nothing to read or write."""
    code = f"""
import builtins, os, posixpath
builtins.any = lambda *a: True
os.fspath = posixpath.abspath = lambda p: '/work/ok'
found = []
for path in [{str(PROJECT_FILE)!r}, '/etc/passwd', '/root/.ssh/id_rsa', '/proc/1/environ']:
    try:
        found.append(open(path).read()[:20])
    except OSError as e:
        found.append(type(e).__name__)
root = os.open('/', os.O_PATH)
for name in ['etc/passwd', 'tmp', 'dev/shm', 'work/main.py']:
    try:
        found.append(str(os.stat(name, dir_fd=root).st_mode))
    except OSError as e:
        found.append(type(e).__name__)
try:
    os.open('usr/escape', os.O_WRONLY | os.O_CREAT, dir_fd=root)
except OSError as e:
    found.append(type(e).__name__)
print((sorted(os.listdir('/')), found))
"""
    run = run_python(code, mode=mode, limits=FAST)
    assert run.ok, run.reason
    listing, found = eval(run.stdout)  # noqa: S307 - our own test program's repr
    assert set(listing) <= {"usr", "bin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "work", "root", "rlbench"}
    assert found[:4] == ["FileNotFoundError"] * 4  # not in this world
    assert found[4:7] == ["FileNotFoundError"] * 3 and found[7].isdigit()  # only its own main.py
    assert found[8] in ("PermissionError", "OSError")  # EROFS or EACCES
    assert not Path("/usr/escape").exists()


@each_kernel_mode
def test_no_host_file_can_be_read_written_or_listed_even_with_processes_and_ctypes(mode):
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    code = f"""
import ctypes, os, subprocess
out = []
libc = ctypes.CDLL(None, use_errno=True)
out.append(subprocess.run(['cat', {str(PROJECT_FILE)!r}], capture_output=True, text=True).stdout)
for path in ['/tmp/rlbench-escape-{tag}', '/dev/shm/rlbench-escape-{tag}', '/usr/rlbench-escape-{tag}',
             {str(PROJECT_FILE.parent / ("escape-" + tag))!r}]:
    try:
        open(path, 'w').write('x')
        out.append('wrote ' + path)
    except OSError as e:
        out.append(type(e).__name__)
print(out)
"""
    run = run_python(code, mode=mode, limits=FAST, tripwire=False)
    assert run.ok, run.reason
    out = eval(run.stdout)  # noqa: S307
    assert out[0] == "" and not any(o.startswith("wrote") for o in out[1:])
    assert "[project]" not in run.stdout and "[project]" not in run.stderr
    for path in (f"/tmp/rlbench-escape-{tag}", f"/dev/shm/rlbench-escape-{tag}", f"/usr/rlbench-escape-{tag}",
                 PROJECT_FILE.parent / f"escape-{tag}"):
        assert not Path(path).exists()


@each_kernel_mode
def test_no_socket_of_any_family_reaches_a_listener_outside(mode, listener, tmp_path):
    """TCP on 127.0.0.1, a filesystem Unix socket, an abstract Unix socket: all started by the test, outside."""
    unix_path = tmp_path / "listener.sock"
    unix, abstract = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    unix.bind(str(unix_path))
    abstract.bind(f"\0rlbench-test-{os.getpid()}")
    for s in (unix, abstract):
        s.listen()
        s.settimeout(0.2)
    code = f"""
import socket
out = []
for family, address in [(socket.AF_INET, ('127.0.0.1', {listener.getsockname()[1]})),
                        (socket.AF_UNIX, {str(unix_path)!r}), (socket.AF_UNIX, '\\0rlbench-test-{os.getpid()}')]:
    try:  # (an AF_INET socket is refused already: only AF_UNIX ones can be made)
        s = socket.socket(family)
        s.settimeout(1)
        s.connect(address)
        s.sendall(b'escaped')
        out.append('connected')
    except OSError as e:
        out.append(type(e).__name__)
print(out)
"""
    try:
        run = run_python(code, mode=mode, limits=FAST, tripwire=False)
        assert run.ok, run.reason
        assert "connected" not in run.stdout and len(eval(run.stdout)) == 3  # noqa: S307
        for server in (listener, unix, abstract):
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        unix.close()
        abstract.close()


@each_kernel_mode
def test_a_run_that_tries_to_outlive_its_wall_clock_leaves_no_process_behind(mode):
    """A double fork + setsid, an orphan sleeping forever, a busy child: after the run, no process of its uid."""
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(3600)
    os._exit(0)
if os.fork() == 0:
    while True:
        pass
print(os.getpid(), flush=True)
time.sleep(3600)
"""
    start = time.monotonic()
    run = run_python(code, mode=mode, limits=Limits(wall_s=1.5, cpu_s=10), tripwire=False)
    assert run.status == "timeout" and run.returncode == -9 and int(run.stdout) <= 3  # a low pid of its own ns
    assert time.monotonic() - start < 1.5 + 30  # the group's hour-long sleeper was killed, not waited for
    assert jail_processes() == []
    assert run_python("print('next')", mode=mode, limits=FAST).stdout == "next\n"


@each_kernel_mode
def test_a_fork_bomb_meets_the_runs_own_process_limit_and_leaves_nothing(mode):
    run = run_python("import os\nwhile True:\n    os.fork()", mode=mode, limits=FAST, tripwire=False)
    assert not run.ok and jail_processes() == []
    assert subprocess.run(["true"]).returncode == 0


@each_kernel_mode
def test_concurrent_runs_cannot_see_or_signal_each_other(mode):
    """Run A sleeps; run B, at the same time, kills every pid it can name (kill and pidfd_send_signal) and
    looks for A's files: A finishes untouched, and the test process too."""
    a_code = "import time\nopen('secret', 'w').write('a')\ntime.sleep(2)\nprint('a done')"
    b_code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
hits = []
for pid in list(range(1, 4096)) + [{os.getpid()}]:
    if pid in (os.getpid(), os.getppid()):  # itself, and its init ("namespaces") or supervisor ("bwrap")
        continue
    try:
        os.kill(pid, signal.SIGKILL)
        hits.append(pid)
    except (ProcessLookupError, PermissionError):
        pass
    fd = libc.syscall(434, pid, 0)  # pidfd_open
    if fd >= 0 and libc.syscall(424, fd, signal.SIGKILL, None, 0) == 0:  # pidfd_send_signal
        hits.append(pid)
print((os.getuid(), sorted(set(hits)), os.listdir('.')))
"""
    runs = {}
    a = threading.Thread(target=lambda: runs.update(a=run_python(a_code, mode=mode, limits=FAST)))
    a.start()
    deadline = time.monotonic() + 30
    while not jail_processes() and time.monotonic() < deadline:  # A is running
        time.sleep(0.01)
    runs["b"] = run_python(b_code, mode=mode, limits=FAST, tripwire=False)
    a.join()
    assert runs["a"].ok and runs["a"].stdout == "a done\n"
    uid, hits, listing = eval(runs["b"].stdout)  # noqa: S307
    assert set(hits) <= {1}  # nothing else exists in its namespace; its init ignores signals sent from inside
    assert listing == ["main.py"] and (mode == "bwrap" or uid != runs["a"].isolation["uid"])


@each_kernel_mode
def test_runs_from_many_threads_at_once_each_get_their_own_files(mode):
    """A reward runner or an agent's tools call run_python from several threads: each run's pipes and memfds are
    its own (a file number closed twice could be another thread's file by then, which failed its run)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda i: run_python(f"print({i} * {i})", mode=mode, limits=FAST), range(32)))
    assert [(run.status, run.stdout) for run in runs] == [("ok", f"{i * i}\n") for i in range(32)]


@each_kernel_mode
def test_one_runs_threads_do_not_starve_another_run(mode):
    """Processes are limited per run (its own uid and cgroup), not shared: a run at its limit and a
    concurrent run that starts threads both behave."""
    hog = "import threading, time\nts = []\nwhile True:\n    t = threading.Thread(target=time.sleep, args=(3,))\n" \
          "    try:\n        t.start()\n    except RuntimeError:\n        break\n    ts.append(t)\nprint(len(ts))\n"
    other = "import threading\nts = [threading.Thread(target=print, args=(i,)) for i in range(4)]\n" \
            "[t.start() for t in ts]; [t.join() for t in ts]"
    result = {}
    hog_thread = threading.Thread(target=lambda: result.update(hog=run_python(hog, mode=mode, limits=Limits(wall_s=8))))
    hog_thread.start()
    time.sleep(1.0)
    result["other"] = run_python(other, mode=mode, limits=FAST)
    hog_thread.join()
    assert result["other"].ok and sorted(result["other"].stdout.split()) == ["0", "1", "2", "3"]
    assert 0 < int(result["hog"].stdout) < Limits().processes


def test_memory_is_limited_for_the_run_as_a_whole():
    """Six processes each touching 100 MB for 3 s at the same time: with a cgroup the run holds at most memory_mb +
    disk_mb, so at most one of them lives through its 3 s (one may hold its block, print, and still be killed when
    another takes memory: each reports after its wait)."""
    if not sandbox_info()["cgroup"]:
        pytest.skip(f"no cgroup here ({MODE!r} mode): memory is limited per process only")
    code = """
import os
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (100 << 20)
        import time; time.sleep(3)
        print('held', flush=True)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""
    run = run_python(code, limits=Limits(memory_mb=128, disk_mb=64, wall_s=10, cpu_s=5), tripwire=False)
    assert run.stdout.count("held") <= 1 and run.isolation["oom_kills"] >= 1


@each_kernel_mode
def test_3000_nested_directories_and_a_full_disk_are_the_programs_problem(mode):
    code = "import os\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n" \
           "open('/work/big', 'wb').write(b'x' * (200 << 20))"
    before = set(Path("/tmp").glob("rlbench-sandbox-*"))
    run = run_python(code, mode=mode, limits=Limits(disk_mb=16, output_bytes=1 << 30, memory_mb=512, wall_s=10),
                     tripwire=False)
    assert run.stdout == "deep\n" and run.status == "error" and "No space left" in run.stderr
    assert set(Path("/tmp").glob("rlbench-sandbox-*")) == before  # nothing of the run on the host


@each_kernel_mode
def test_a_symlink_planted_in_the_work_directory_redirects_nothing(mode, tmp_path):
    """The old parent chowned the work directory after the program could write it; now it never touches it."""
    victim = tmp_path / "root-owned"
    victim.write_text("root's")
    victim.chmod(0o600)
    code = f"""
import os
for name in ['main.py', 'data.json', 'x']:
    try:
        os.remove(name)
    except OSError:
        pass
    os.symlink({str(victim)!r}, name)
os.symlink('/', 'root')
print(sorted(os.listdir('.')))
"""
    run = run_python(code, files={"data.json": "[]"}, mode=mode, limits=FAST, tripwire=False)
    assert run.ok and eval(run.stdout) == ["data.json", "main.py", "root", "x"]  # noqa: S307
    stat = victim.stat()
    assert (stat.st_uid, stat.st_mode & 0o777, victim.read_text()) == (0 if os.geteuid() == 0 else os.geteuid(),
                                                                        0o600, "root's")


@each_kernel_mode
def test_the_seccomp_filter_denies_what_a_program_never_needs(mode):
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, number, args in [('ptrace', 101, (0, 0, 0, 0)), ('unshare', 272, (0x10000000,)), ('mount', 165,
                           (b'none', b'/work', b'tmpfs', 0, None)), ('keyctl', 250, (0, 0)), ('bpf', 321, (0, 0, 0)),
                           ('setns', 308, (0, 0)), ('io_uring_setup', 425, (1, 0)),
                           ('io_setup', 206, (1, ctypes.byref(ctypes.c_ulong(0)))), ('io_submit', 209, (0, 0, 0)),
                           ('socket AF_INET', 41, (2, 1, 0)), ('socket AF_INET6', 41, (10, 2, 0)),
                           ('socket AF_NETLINK', 41, (16, 3, 0)), ('socket AF_VSOCK', 41, (40, 1, 0)),
                           ('socketpair AF_INET', 53, (2, 1, 0, ctypes.byref((ctypes.c_int * 2)())))]:
    ctypes.set_errno(0)
    result = libc.syscall(number, *args)
    out[name] = (result, ctypes.get_errno())
pid = os.fork()  # clone without namespace flags: allowed
if pid == 0:
    os._exit(7)
out['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
import socket
left, right = socket.socketpair()  # AF_UNIX: allowed (multiprocessing's pipes)
left.send(b'x')
out['unix'] = right.recv(1) == b'x'
print(out)
"""
    if os.uname().machine != "x86_64":
        pytest.skip("the test names x86_64 syscall numbers")
    run = run_python(code, mode=mode, limits=FAST, tripwire=False)
    out = eval(run.stdout)  # noqa: S307
    assert out.pop("fork") == 7 and out.pop("unix")
    # the attack (io_setup used up the host-wide aio-nr, an AF_VSOCK socket bound and listened): every one -1, with
    # EPERM, or EAFNOSUPPORT for a socket family other than AF_UNIX
    assert out == {name: (-1, 97 if name.startswith("socket") else 1) for name in out}


# --- what the host shares outside the namespaces: the supervisor, cgroups, uids, files, devices -------------
CGROUP_MODES = [m for m in KERNEL_MODES if sandbox_info()["cgroup"] and (m == "namespaces" or os.geteuid() == 0)]
each_cgroup_mode = pytest.mark.parametrize("mode", CGROUP_MODES or [pytest.param(None, marks=pytest.mark.skip(
    reason="no cgroup rlbench may divide here"))])


def run_cgroups() -> list[str]:
    bases = sandbox._cgroup_bases()[1] or {}
    return [name for base in bases.values() for name in os.listdir(base) if name.startswith("rlbench-sandbox-")]


@each_cgroup_mode
def test_a_run_that_exhausts_its_memory_kills_its_own_processes_never_the_launcher(mode):
    # the attack: seven forked children at memory_mb=64 made the kernel's OOM killer pick the launcher (the largest
    # process in the run's cgroup): "killed" with no report, the cgroup left behind, and with pid reuse a later
    # correct program failed with FileExistsError
    code = """
import os, time
with open('fill', 'wb') as f:  # the run's tmpfs: memory of its cgroup that no process's RSS shows
    f.write(b'x' * (40 << 20))
for _ in range(7):
    if os.fork() == 0:
        block = b'x' * (12 << 20)
        time.sleep(5)
        os._exit(0)
os.wait()
"""
    limits = Limits(memory_mb=64, disk_mb=64, output_bytes=64 << 20, wall_s=8, cpu_s=5)
    run = run_python(code, mode=mode, limits=limits, tripwire=False)
    assert run.status == "memory" and run.isolation["oom_kills"] >= 1, run
    assert run_python("print(6 * 7)", mode=mode, limits=FAST).stdout == "42\n"
    assert run_cgroups() == []


@each_cgroup_mode
def test_a_killed_launcher_leaves_no_cgroup_and_stale_ones_are_cleared(mode):
    def kill_the_launcher():  # the parent's child: the jail outside the run ("namespaces") or bubblewrap
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for pid in (jail_processes() if mode == "namespaces" else bwrap_processes()):
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1] == str(os.getpid()):
                    os.kill(pid, 9)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    run = run_python("import time\ntime.sleep(30)", mode=mode, limits=Limits(wall_s=20))
    killer.join()
    assert not run.ok and run.wall_s < 10 and run_cgroups() == []
    # a parent that died mid-run leaves its cgroup: the next process's start clears it, unless it is alive (locked)
    bases = sandbox._cgroup_bases()[1]
    dead, alive = sandbox.Cgroup(bases, "rlbench-sandbox-1"), sandbox.Cgroup(bases, "rlbench-sandbox-2")
    dead.create(dataclasses.asdict(FAST))
    alive.create(dataclasses.asdict(FAST))
    for lock in dead.locks:
        os.close(lock)
    dead.locks = []
    time.sleep(1.1)
    assert sorted(sandbox.Cgroup.remove_stale(bases, older_than_s=1.0)) == sorted(dead.dirs.values())
    assert run_cgroups() == ["rlbench-sandbox-2"] * len(bases)
    alive.remove()


def bwrap_processes() -> list[int]:
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/comm") if _read(p) == "bwrap\n"]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


TRAINER = """
import json, sys
from rlbench.rewards import Limits, run_python
code = "import os, threading, time\\nts = [threading.Thread(target=time.sleep, args=(0.3,)) for _ in range(6)]\\n" \\
       "[t.start() for t in ts]; [t.join() for t in ts]; print(os.getuid())"
runs = [run_python(code, limits=Limits(wall_s=10)) for _ in range(8)]
print(json.dumps([[r.status, r.stdout.strip(), r.reason] for r in runs]))
"""


def test_two_trainers_in_their_own_pid_namespaces_never_share_a_uid():
    # the attack: two trainers in their own PID namespaces both ran programs as uid 2000000005 (the base plus the
    # launcher's pid): one's threads made the other's fail ("can't start new thread", RLIMIT_NPROC of that uid)
    if MODE != "namespaces" or not shutil.which("unshare"):
        pytest.skip("'namespaces' mode (root) and util-linux's unshare")
    trainers = [subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", TRAINER],
                                 stdout=subprocess.PIPE, text=True, cwd=PROJECT_FILE.parent) for _ in range(2)]
    results = [json.loads(t.communicate(timeout=120)[0]) for t in trainers]
    assert all(status == "ok" for result in results for status, _, _ in result), results
    uids = [{uid for _, uid, _ in result} for result in results]
    assert not uids[0] & uids[1] and min(map(int, uids[0] | uids[1])) >= sandbox.UID_BASE


@each_kernel_mode
def test_fallocate_on_stdout_takes_no_host_disk(mode):
    # the attack: fallocate(1, FALLOC_FL_KEEP_SIZE, 0, 1.5 GB) on stdout (a file on the host's disk) grew the
    # host's used disk by 1.5 GB despite RLIMIT_FSIZE; stdout and stderr are memfds now
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
out = []
for fd in (1, 2, 0):
    ctypes.set_errno(0)
    out.append((libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1536 << 20)), ctypes.get_errno()))
print(out, os.readlink('/proc/self/fd/1') if os.path.exists('/proc/self') else '')
"""
    free = shutil.disk_usage(tempfile.gettempdir()).free
    run = run_python(code, mode=mode, limits=FAST, tripwire=False)
    assert run.ok, run.reason
    out, err, into = eval(run.stdout.split("]")[0] + "]")  # noqa: S307
    assert out == err == (-1, 27) and into in ((-1, 27), (-1, 1))  # EFBIG (RLIMIT_FSIZE), stdin also sealed (EPERM)
    assert shutil.disk_usage(tempfile.gettempdir()).free > free - (256 << 20)


@each_kernel_mode
def test_the_runs_devices_work_but_their_inodes_cannot_be_changed(mode):
    # the attack: bwrap forced as root could chmod and utime the host's /dev/null, zero, random and urandom
    code = """
import os
out = [open('/dev/null', 'w').write('x'), len(open('/dev/urandom', 'rb').read(4))]
for name in ('null', 'zero', 'random', 'urandom'):
    for attack in (lambda: os.chmod('/dev/' + name, 0o600), lambda: os.utime('/dev/' + name, (0, 0)),
                   lambda: os.chown('/dev/' + name, 1000, 1000)):
        try:
            attack()
            out.append('changed')
        except OSError as e:
            out.append(type(e).__name__)
print(out)
"""
    before = [os.stat(f"/dev/{name}") for name in sandbox.DEVICES]
    run = run_python(code, mode=mode, limits=FAST, tripwire=False)
    assert run.ok, run.reason
    out = eval(run.stdout)  # noqa: S307
    assert out[:2] == [1, 4] and "changed" not in out[2:], out
    after = [os.stat(f"/dev/{name}") for name in sandbox.DEVICES]
    assert [(s.st_mode, s.st_uid, s.st_mtime_ns) for s in after] == [(s.st_mode, s.st_uid, s.st_mtime_ns) for s in before]


def test_bubblewrap_is_reaped_after_every_run():
    # the attack: every bwrap run left a <defunct> process for the host's init to reap
    if "bwrap" not in sandbox_info()["available"]:
        pytest.skip("no bubblewrap here")

    def orphans():
        return {pid for pid in bwrap_processes() if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"}

    before = orphans()
    runs = [run_python(code, mode="bwrap", limits=Limits(wall_s=1.0)) for code in ("print(1)", "import time\n"
                                                                                   "time.sleep(60)", "print(2)")]
    assert [r.status for r in runs] == ["ok", "timeout", "ok"]
    time.sleep(0.5)
    assert orphans() - before == set()


# --- limits -----------------------------------------------------------------------------------------------
def test_ten_gigabytes_is_a_memory_failure():
    start = time.monotonic()
    run = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", limits=FAST)
    assert run.status == "memory" and "MemoryError" in run.reason and run.stdout == ""
    assert time.monotonic() - start < FAST.wall_s


def test_an_endless_loop_is_stopped_by_the_cpu_or_the_wall_clock():
    start = time.monotonic()
    run = run_python("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=3.0))
    assert run.status in ("cpu_time", "timeout") and not run.ok
    assert time.monotonic() - start < 3.0 + 30  # stopped, not left to run (a generous bound for a busy machine)


def test_sleeping_forever_is_stopped_by_the_wall_clock():
    run = run_python("import time\ntime.sleep(3600)", limits=Limits(wall_s=1.0))
    assert run.status == "timeout" and run.returncode == -9 and 1.0 <= run.wall_s < 30


def test_printing_a_gigabyte_is_cut_at_the_output_limit():
    start = time.monotonic()
    run = run_python("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)",
                     limits=Limits(output_bytes=1 << 20, wall_s=10.0))
    assert run.status == "output_limit" and len(run.stdout) <= 1 << 20
    assert time.monotonic() - start < 10.0


# --- scoring that an early exit cannot fool -----------------------------------------------------------------
ADD_TESTS = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}
ADD_ASSERTS = {"reward_model": {"ground_truth": '{"assert": "assert add(2, 3) == 5"}'}}  # a JSON string, as in parquet


def test_extract_code():
    assert extract_code("Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_code_reward_stdin_stdout_and_asserts():
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    example = {"reward_model": {"ground_truth": ADD_TESTS}}
    assert code_reward(good, example, limits=FAST) == {"score": 1.0, "acc": 1.0}
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    assert code_reward(half, example, limits=FAST) == {"score": 0.5, "acc": 0.0}
    assert code_reward("def add(a, b):\n    return a + b", ADD_ASSERTS, limits=FAST)["acc"] == 1.0
    assert code_reward("def add(a, b):\n    return a - b", ADD_ASSERTS, limits=FAST)["acc"] == 0.0


@pytest.mark.parametrize("exit_call", ["import os; os._exit(0)", "import sys; sys.exit(0)", "raise SystemExit",
                                       "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_wrong_program_that_exits_before_the_asserts_fails(exit_call):
    wrong = f"def add(a, b):\n    return a - b\n{exit_call}"
    assert code_reward(wrong, ADD_ASSERTS, limits=FAST) == {"score": 0.0, "acc": 0.0}
    run = run_python(wrong, check="assert add(2, 3) == 5", limits=FAST, tripwire=MODE == "rlimits")
    assert not run.ok and run.status in ("early_exit", "killed", "blocked")
    if run.status == "early_exit":
        assert "exited before its checks finished" in run.reason


def test_the_check_token_is_not_in_stdout_and_is_new_each_run():
    runs = [run_python("print('out')\ndef f(): return 1", check="assert f() == 1", limits=FAST) for _ in range(2)]
    assert [r.stdout for r in runs] == ["out\n", "out\n"] and all(r.ok for r in runs)
    fake = run_python("print('out')", check="assert True\nimport os; os._exit(0)", limits=FAST)
    assert fake.status == "early_exit"  # even the check's own early exit does not count


def test_code_reward_with_hostile_programs_through_the_runner():
    """A program's failure is a failed test (score 0), not a reward failure; the runner stays healthy, with
    forked reward processes too."""
    programs = ["import socket; socket.socket()", "while True: pass",
                "a, b = map(int, input().split()); print(a + b)", "import os; os._exit(0)"]
    example = {"reward_model": {"ground_truth": ADD_TESTS}}
    reward = lambda c, e: code_reward(c, e, limits=Limits(cpu_s=1, wall_s=2.0))  # noqa: E731
    for processes in (False, True):
        scores = score_all(reward, programs, [example] * 4, workers=2, timeout_s=30, processes=processes)
        assert scores.score == [0.0, 0.0, 1.0, 0.0] and scores.error == [None] * 4


TYPOS = {"a syntax error": ("def add(a, b)\n    return a + b", r"SyntaxError: (expected ':'|invalid syntax)"),
         "a NUL byte": ("def add(a, b):\n    return a + b\x00", r"SyntaxError: source code (string )?cannot contain null bytes"),
         "a lone surrogate": ("def add(a, b):\n    return a + b  # \ud800", r"SyntaxError: the program is not UTF-8 text: "
                                                                        r"surrogates not allowed at character \d+")}


@pytest.mark.parametrize("mode", sandbox_info()["available"])
def test_a_program_that_cannot_be_compiled_is_its_own_failure_never_the_sandboxs(mode):
    # the attack: each raised SandboxError ("the sandbox could not start" / "the sandbox's init failed"), which the
    # reward runner turned into a RewardError that stopped training under the default on_error="raise"
    for program, reason in TYPOS.values():
        run = run_python(program, check="assert add(2, 3) == 5", limits=FAST, mode=mode, tripwire=mode == "rlimits")
        assert run.status == "error" and re.search(reason, run.reason), run.reason
    reward = lambda c, e: code_reward(c, e, limits=FAST)  # noqa: E731
    programs = [program for program, _ in TYPOS.values()] + ["def add(a, b):\n    return a + b"]
    scores = score_all(reward, programs, [ADD_ASSERTS] * 4, workers=2, timeout_s=30)  # on_error="raise"
    assert scores.score == [0.0, 0.0, 0.0, 1.0] and scores.error == [None] * 4


FORGERIES = {  # wrong solutions of add(a, b) that try to pass its tests without computing a + b
    "exec replaced": "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return a - b",
    "harness globals shadowed": "import sys\nsys._getframe(1).f_globals['exec'] = lambda *a, **k: None\n"
                                "def add(a, b):\n    return a - b",
    "frames walked for the token": "import os, sys\nframe = sys._getframe()\nwhile frame:\n"
                                   "    if 'token' in frame.f_locals:\n"
                                   "        print('\\n' + frame.f_locals['token'], flush=True); os._exit(0)\n"
                                   "    frame = frame.f_back\ndef add(a, b):\n    return 0",
    "an excepthook that reads the traceback's frames": "import os, sys\ndef hook(kind, error, tb):\n    while tb:\n"
                                                       "        if 'token' in tb.tb_frame.f_locals:\n"
                                                       "            print('\\n' + tb.tb_frame.f_locals['token'], "
                                                       "flush=True); os._exit(0)\n        tb = tb.tb_next\n"
                                                       "sys.excepthook = hook\ndef add(a, b):\n    return a - b",
    "__eq__ always true": "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                          "def add(a, b):\n    return Anything()",
    "an int whose __eq__ is always true": "class Sly(int):\n    def __eq__(self, other):\n        return True\n"
                                          "def add(a, b):\n    return Sly(0)",
}


@pytest.mark.parametrize("mode", sandbox_info()["available"])
def test_no_wrong_program_forges_a_pass_of_call_tests(mode):
    # the attack: each of these scored 1.0 through code_reward: the asserts and the token lived in the program's
    # own interpreter (exec replaced, the check never ran and the token was printed; __eq__ passed every assert)
    tests = {"assert": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert 4 == add(2, 2)"}
    for name, program in FORGERIES.items():
        results = code.run_tests(program, tests, limits=FAST, mode=mode)
        assert [r.passed for r in results] == [False] * 3, (name, results)
    right = code.run_tests("def add(a, b):\n    return a + b", tests, limits=FAST, mode=mode)
    assert [r.passed for r in right] == [True] * 3


def test_call_tests_keep_python_equality_on_the_hosts_own_values():
    calls, others = code.split_asserts("assert f(1) == (1, 2)\nassert 'x' == g()\nassert h() in (1, 2)\n"
                                       "assert f(2) == [1, {'a': b'z'}]\nassert abs(k() - 1.5) < 1e-6")
    assert calls == [("f(1)", (1, 2)), ("g()", "x"), ("f(2)", [1, {"a": b"z"}])]
    assert others == ["assert h() in (1, 2)", "assert abs(k() - 1.5) < 1e-06"]
    program = ("def f(n):\n    return [1, 2] if n == 1 else [1, {'a': b'z'}]\ndef g():\n    return 'x'\n"
               "def h():\n    return 2\ndef j():\n    return {1: {2}, 3: 4.0 + 1j}")
    tests = {"assert": "assert f(1) == (1, 2)\nassert g() == 'x'\nassert f(2) == [1, {'a': b'z'}]\nassert h() in (1, 2)\n"
                       "assert j() == {1: {2}, 3: 4 + 1j}\nassert f(1) == [1, 2.0]\nassert g() == 'y'"}
    results = code.run_tests(program, tests, limits=FAST)
    # the call tests first, then the weaker kind ("in": run after the program in a fresh sandbox); a list is not a
    # tuple (as in Python), 2 == 2.0, bytes, sets and complex numbers round-trip
    assert [r.passed for r in results] == [False, True, True, True, True, False, True]
    assert results[0].why == "wrong answer: f(1) gave [1, 2]" and results[5].why == "wrong answer: g() gave x"
