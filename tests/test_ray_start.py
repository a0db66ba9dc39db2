"""A private Ray instance that misses Ray's 30 s startup window on a loaded machine is started again.

The failure itself is faked (Ray's own exception, raised by the first `ray.init` call): it cannot be provoked on
purpose, only by load. The second start is real."""

import sys

import pytest

from rlbench import cluster
from rlbench.cluster import Ray, acquire_ray, release_ray

TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


def test_a_start_that_timed_out_is_tried_again_and_other_errors_are_not(monkeypatch):
    if "ray" not in sys.modules:
        cluster._private_settings()  # as acquire_ray does before Ray is first imported (a loopback-only instance)
    import ray

    real_init, calls = ray.init, []

    def init(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise TIMED_OUT
        return real_init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    with pytest.warns(UserWarning, match=r"did not start \(The current node timed out .*\); starting it again "
                                         r"\(2 more tries\)"):
        acquire_ray(Ray(), cpus_needed=1)
    try:
        assert ray.is_initialized() and len(calls) == 2 and calls[0] == calls[1]
    finally:
        release_ray()
    assert not ray.is_initialized()

    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad address")))
    with pytest.raises(ValueError, match="bad address"):  # not a startup time-out: raised at once
        cluster._start_private(1)
