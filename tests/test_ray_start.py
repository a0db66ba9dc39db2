"""A private Ray instance that misses Ray's 30 s startup window on a loaded machine is started again.

The failure itself is faked (Ray's own exception, raised by the first `ray.init` call): it cannot be provoked on
purpose, only by load. The second start is real. It runs in a fresh process: a test worker may already hold a Ray
instance, which `acquire_ray` would reuse without starting one."""

import json
import subprocess
import sys

from rlbench.workers import cluster

CHILD = """
import json, warnings
from rlbench.workers import cluster
from rlbench.workers.cluster import Ray, acquire_ray, release_ray
cluster._private_settings()  # as acquire_ray does before Ray is first imported
import ray

real_init, calls = ray.init, []

def init(*args, **kwargs):
    calls.append(kwargs)
    if len(calls) == 1:
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")
    return real_init(*args, **kwargs)

ray.init = init
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acquire_ray(Ray(), cpus_needed=1)
started = ray.is_initialized()
release_ray()
ray.init = lambda *a, **k: (_ for _ in ()).throw(ValueError("bad address"))
try:
    cluster._start_private(1)
    other = "no error"
except ValueError as e:
    other = str(e)
print(json.dumps({"calls": len(calls), "same": calls[0] == calls[1], "started": started,
                  "after": ray.is_initialized(), "warnings": [str(w.message) for w in caught], "other": other}))
"""


def test_a_start_that_timed_out_is_tried_again_and_other_errors_are_not():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["calls"] == 2 and facts["same"] and facts["started"] and not facts["after"]
    assert len(facts["warnings"]) == 1 and facts["warnings"][0].startswith(
        "the private Ray instance did not start (The current node timed out during startup.")
    assert facts["warnings"][0].endswith(f"starting it again ({cluster.PRIVATE_START_TRIES - 1} more tries)")
    assert facts["other"] == "bad address"  # not a startup time-out: raised at once, not retried
