"""The code sandbox: hostile programs end in a recorded failure within their limits; the machine is unharmed."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

import rlbench
from rlbench.rewards import Limits, code_reward, extract_code, run_python, score_all

PROJECT_FILE = Path(rlbench.__file__).resolve().parents[1] / "pyproject.toml"
FAST = Limits(cpu_s=2, wall_s=4.0, memory_mb=256, output_bytes=1 << 20)


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


def test_isolation_in_force_is_reported():
    isolation = run_python("pass", limits=FAST).isolation
    assert isolation["audit_hook"] is True and "network_namespace" in isolation and "user" in isolation
    if os.geteuid() == 0:  # the project's machines: root, so the program runs as nobody in its own netns
        assert isolation["user"] == "nobody" and isolation["network_namespace"] is True


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records whether anybody connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    yield server
    server.close()


HOSTILE = {
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')",
    "write outside": "open('/tmp/rlbench-sandbox-escape-{tag}.txt', 'w').write('x')",
    "read ~/.ssh": "print(open({ssh!r}).read())",
    "read the project": "print(open({project!r}).read())",
    "list the project": "import os\nprint(os.listdir({project_dir!r}))",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['cat', {project!r}])",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_programs_are_blocked(name, listener):
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    code = HOSTILE[name].format(port=listener.getsockname()[1], tag=tag, ssh=str(Path.home() / ".ssh" / "id_rsa"),
                                project=str(PROJECT_FILE), project_dir=str(PROJECT_FILE.parent))
    run = run_python(code, limits=FAST)
    assert run.status == "blocked" and run.returncode == 125 and "sandbox: blocked" in run.reason
    assert run.stdout == ""
    assert not Path(f"/tmp/rlbench-sandbox-escape-{tag}.txt").exists()
    with pytest.raises(socket.timeout):
        listener.accept()  # nobody connected


def test_ten_gigabytes_is_a_memory_failure():
    start = time.monotonic()
    run = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", limits=FAST)
    assert run.status == "memory" and "MemoryError" in run.reason and run.stdout == ""
    assert time.monotonic() - start < FAST.wall_s


def test_an_endless_loop_is_stopped_by_the_cpu_or_the_wall_clock():
    start = time.monotonic()
    run = run_python("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=3.0))
    assert run.status in ("cpu_time", "timeout") and not run.ok
    assert time.monotonic() - start < 3.0 + 2.0


def test_sleeping_forever_is_stopped_by_the_wall_clock():
    run = run_python("import time\ntime.sleep(3600)", limits=Limits(wall_s=1.0))
    assert run.status == "timeout" and run.returncode == -9 and 1.0 <= run.wall_s < 3.0


def test_printing_a_gigabyte_is_cut_at_the_output_limit():
    start = time.monotonic()
    run = run_python("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)",
                     limits=Limits(output_bytes=1 << 20, wall_s=10.0))
    assert run.status == "output_limit" and len(run.stdout) <= 1 << 20
    assert time.monotonic() - start < 10.0


def test_the_machine_is_unharmed_afterwards(tmp_path):
    """After the fork bomb and friends: we can still start processes, and no sandbox process is left."""
    run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert subprocess.run(["true"]).returncode == 0
    leftovers = subprocess.run(["pgrep", "-u", "nobody", "-f", "rlbench-sandbox"], capture_output=True, text=True)
    assert leftovers.stdout == ""


# --- code reward ---------------------------------------------------------------------------------------------
ADD_TESTS = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}


def test_extract_code():
    assert extract_code("Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_code_reward_stdin_stdout_and_asserts():
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    example = {"reward_model": {"ground_truth": ADD_TESTS}}
    assert code_reward(good, example, limits=FAST) == {"score": 1.0, "acc": 1.0}
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    assert code_reward(half, example, limits=FAST) == {"score": 0.5, "acc": 0.0}
    asserts = {"reward_model": {"ground_truth": '{"assert": "assert add(2, 3) == 5"}'}}  # a JSON string, as in parquet
    assert code_reward("def add(a, b):\n    return a + b", asserts, limits=FAST)["acc"] == 1.0
    assert code_reward("def add(a, b):\n    return a - b", asserts, limits=FAST)["acc"] == 0.0


def test_code_reward_with_hostile_programs_through_the_runner():
    """A program's failure is a failed test (score 0), not a reward failure; the runner stays healthy."""
    programs = ["import socket; socket.socket()", "while True: pass",
                "a, b = map(int, input().split()); print(a + b)"]
    example = {"reward_model": {"ground_truth": ADD_TESTS}}
    reward = lambda c, e: code_reward(c, e, limits=Limits(cpu_s=1, wall_s=2.0))  # noqa: E731
    scores = score_all(reward, programs, [example] * 3, workers=3, timeout_s=30)
    assert scores.score == [0.0, 0.0, 1.0] and scores.error == [None] * 3
