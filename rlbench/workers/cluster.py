"""Where workers live: in this process (inline) or in Ray actors, behind one interface.

A `WorkerGroup` is `size` hosts (one per rank). A host is a process that holds named objects (a
policy rank, a reference rank, a critic rank, a sampler): objects built on the same host are
colocated. The driver calls a method of one object on every rank, naming the method by the function
itself (`group.call("policy", Policy.log_probs, batch)`, never by a string), so a reader and a tool can
follow the call to the code that runs; `submit` starts a call without waiting for it (`Pending`), so that calls
queued on a rank cost the driver one wait; `map_rows` / `map_shards` split a Batch's tensor columns across ranks
(balanced by token count) and put the results back in row order. Nothing is hidden behind decorators: every split and
merge is in this file. The typed handles the session hands out (`rlbench.workers`) are built on these calls.

Ray: with no address the session starts a private local instance (never attaching to another cluster
on the machine) and shuts it down when its last session closes; with `Ray(address=...)` or RAY_ADDRESS
it joins that cluster and only disconnects.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlbench.batch import Batch


@dataclass(frozen=True)
class Ray:
    """Run the session's workers as Ray actors."""

    address: str | None = None
    """A cluster to join ("auto", "ray://host:port", "host:port"); None = RAY_ADDRESS, else a private local instance."""
    num_cpus: int | None = None
    """Logical CPUs of a private local instance (None = enough for the session's actors)."""
    nodes: str | dict[str, str] = "any"
    """Which nodes of the cluster the session's worker processes go to (`Placer`): "any", wherever Ray finds room;
    "spread", one placement group of them all spread over as many nodes as it can (the policy's ranks on different
    nodes where there are enough); "pack", on as few nodes as it can; or {role: resource}, a role's processes only on
    nodes that have that custom resource (started with `ray start --resources='{"trainer": 1}'`; each process asks
    for 0.001 of it, so its CPUs decide how many fit), the roles not named anywhere. Roles (`ROLES`): "policy" (and
    what runs in its rank processes), "reference", "teacher", "critic" (placement="separate"), "sampler" (and the
    rollout workers), "rewards" (the reward scorer, or an agentic task's environments)."""

    def __post_init__(self):
        if isinstance(self.nodes, dict):
            unknown = [role for role in self.nodes if role not in ROLES]
            if unknown or not all(isinstance(v, str) and v for v in self.nodes.values()):
                raise ValueError(f"Ray(nodes={self.nodes!r}): give {{role: custom resource name}} with roles among "
                                 f"{', '.join(map(repr, ROLES))}" + (f" (not {', '.join(map(repr, unknown))})"
                                                                    if unknown else ""))
        elif self.nodes not in NODES:
            raise ValueError(f"Ray(nodes={self.nodes!r}) is not one of: {', '.join(map(repr, NODES))}, "
                             f"or {{role: custom resource name}}")


NODES = ("any", "spread", "pack")
"""`Ray.nodes`' strategies."""
ROLES = ("policy", "reference", "teacher", "critic", "sampler", "rewards")
"""`Ray.nodes`' roles: what each group of a session's workers is (`role_of`)."""


def role_of(group: str) -> str:
    """The `Ray.nodes` role of a worker group by its name: a rollout worker's is "sampler", the environments'
    "rewards"."""
    return "sampler" if group.startswith("rollout-") else "rewards" if group == "envs" else group


class WorkerDied(RuntimeError):
    """A worker process ended (killed, out of memory) while the driver waited for it."""


class Host:
    """A worker process's container of named objects (inline, the driver process itself)."""

    def __init__(self, threads: int | None):
        if threads is not None:  # inline, the user's process keeps its own thread count unless told otherwise
            torch.set_num_threads(threads)
        self.objects: dict[str, Any] = {}

    def build(self, name: str, factory: Callable, kwargs: dict) -> None:
        self.objects[name] = factory(**kwargs)

    def call(self, name: str, method: Callable, *args, **kwargs):
        """`method(objects[name], *args, **kwargs)`: `method` is a function of the object's class."""
        return method(self.objects[name], *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def free_address(self) -> str:
        """tcp://<this node's IP>:<a free port>, for torch.distributed's rendezvous."""
        ip = "127.0.0.1"
        try:
            import ray

            if ray.is_initialized():
                ip = ray.util.get_node_ip_address()
        except ImportError:
            pass
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"


class WorkerGroup:
    """`size` hosts: inline objects (size must be 1) or Ray actors with `cpus` CPUs each. `threads`: torch
    threads of each host process (None: leave the process's own, for an inline host in the user's process).
    `concurrency`: calls a Ray host runs at once, in threads (a rollout worker takes weights while it samples).
    `env`: environment variables of a Ray host's process (besides `WORKER_ENV`). `replicas`: consecutive ranks that
    take the same rows and return the same results (a tensor-parallel group, `Config.tensor_parallel`)."""

    def __init__(self, name: str, size: int, *, ray: bool, threads: int | None = 1, cpus: float = 1.0, gpus: float = 0,
                 concurrency: int = 1, env: dict[str, str] | None = None, placer: Placer | None = None,
                 replicas: int = 1):
        self.name, self.size, self.ray, self.replicas = name, size, ray, replicas
        if not ray:
            if size != 1:
                raise ValueError(f"an inline worker group has one rank, not {size}: use cluster='ray'")
            self.hosts = [Host(threads)]
            return
        import ray as ray_module

        actor = ray_module.remote(Host)
        common = dict(num_cpus=cpus, num_gpus=gpus, max_concurrency=concurrency, runtime_env=worker_runtime_env(env))
        where = placer.options(name, size) if placer is not None else [{}] * size
        self.hosts = [actor.options(**common, **options).remote(threads) for options in where]

    # ------------------------------------------------------------------------------ calls
    def build(self, name: str, factory: Callable, kwargs_per_rank: list[dict]) -> None:
        """Construct `factory(**kwargs_per_rank[r])` on every rank r under `name`."""
        self.start_build(name, factory, kwargs_per_rank).result()

    def start_build(self, name: str, factory: Callable, kwargs_per_rank: list[dict]) -> Pending:
        """`build` without waiting for it: on Ray, the groups of a session then load their models at once."""
        return Pending(self, [self._send(h, "build", name, factory, kw) for h, kw in zip(self._open(), kwargs_per_rank)],
                       f"building {name}")

    def call(self, name: str, method: Callable, *args, **kwargs) -> list:
        """`objects[name].method(*args, **kwargs)` on every rank at once; one result per rank."""
        return self.submit(name, method, *args, **kwargs).result()

    def submit(self, name: str, method: Callable, *args, **kwargs) -> Pending:
        """`call` without waiting for it. A rank runs the calls it is sent in the order they were sent, so the
        driver can start several (the policy's and the reference's log-probs) before waiting for the first: on
        Ray the rank then goes from one to the next without waiting for a round trip to the driver (a few
        milliseconds each). Inline the call has run on return."""
        return self.submit_each(name, method, [args] * len(self._open()), **kwargs)

    def submit_each(self, name: str, method: Callable, args_per_rank: list[tuple], **kwargs) -> Pending:
        """Like `submit`, rank r getting `*args_per_rank[r]`."""
        return Pending(self, [self._send(h, "call", name, method, *a, **kwargs)
                              for h, a in zip(self._open(), args_per_rank)], f"{name}.{method.__name__}")

    def ref(self, name: str, method: Callable, rank: int = 0):
        """Start `method` on every rank, return rank `rank`'s result without fetching it to the driver
        (a Ray ObjectRef, or the value inline): pass it on to another worker zero-copy."""
        futures = [self._send(h, "call", name, method) for h in self._open()]
        if self.ray:
            import ray

            ray.wait(futures, num_returns=len(futures), fetch_local=False)
            self._get(futures[:rank] + futures[rank + 1 :], f"{name}.{method.__name__}")
        return futures[rank]

    def map_rows(self, name: str, method: Callable, batch: Batch, **kwargs) -> Pending:
        """Split rows across ranks (balanced by tokens; each group of `replicas` ranks the same rows) and start the
        call; its result puts the `[rows, T]` (or `[rows, T, k]`) results back in the batch's row order (zero-padded to
        the widest)."""
        index = balance(batch, self.size // self.replicas)

        def merge(parts: list[torch.Tensor]) -> torch.Tensor:
            out = parts[0].new_zeros((len(batch), max(p.shape[1] for p in parts), *parts[0].shape[2:]))
            for rows, part in zip(index, parts):
                out[torch.tensor(rows, dtype=torch.long), : part.shape[1]] = part
            return out

        return self._map(name, method, batch, index, **kwargs).then(merge)

    def map_shards(self, name: str, method: Callable, batch: Batch, **kwargs) -> Pending:
        """Split rows across ranks (balanced by tokens; each group of `replicas` ranks the same rows) and start the
        call; its result is one per group of replicas (its first rank's)."""
        return self._map(name, method, batch, balance(batch, self.size // self.replicas), **kwargs)

    def _map(self, name: str, method: Callable, batch: Batch, index: list[list[int]], **kwargs) -> Pending:
        """`method` on each rank with its group's rows `index[rank // replicas]`; the first rank's result of each group.
        On Ray a group's rows go to the object store once, not once per rank of the group."""
        shards = [_shard(batch, rows) for rows in index]
        if self.ray and self.replicas > 1:
            import ray

            shards = [ray.put(shard) for shard in shards]
        return self.submit_each(name, method, [(shards[r // self.replicas],) for r in range(self.size)],
                                **kwargs).then(lambda per_rank: per_rank[:: self.replicas])

    def rendezvous(self) -> str | None:
        """A tcp:// address on rank 0's machine for torch.distributed (None for a one-rank group)."""
        if self.size == 1:
            return None
        return self._get([self._send(self._open()[0], "free_address")], "free_address")[0]

    def pids(self) -> list[int]:
        return self._get([self._send(h, "pid") for h in self._open()], "pid")

    def node_ids(self) -> list[str]:
        """The Ray node each rank runs on (inline: this process's node, or "" where this process is on no Ray)."""
        if not self.ray:
            ray = sys.modules.get("ray")
            return [ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else ""]
        return self._get([h.__ray_call__.remote(_node_id) for h in self._open()], "node_ids")

    def close(self) -> None:
        """End the group's worker processes (Ray actors are killed; inline objects are dropped)."""
        if self.ray:
            import ray

            if ray.is_initialized():  # else Ray is gone, and its actors with it
                for host in self.hosts:
                    ray.kill(host, no_restart=True)
        self.hosts = []

    # --------------------------------------------------------------------------- plumbing
    def _open(self) -> list:
        """The hosts; RuntimeError once the group is closed."""
        if not self.hosts:
            raise RuntimeError(f"the '{self.name}' workers are closed (the session was closed): start a new session, "
                               f"or Session.restore(...) a checkpoint")
        return self.hosts

    def _send(self, host, method: str, *args, **kwargs):
        return getattr(host, method).remote(*args, **kwargs) if self.ray else getattr(host, method)(*args, **kwargs)

    def _get(self, futures: list, what: str) -> list:
        if not self.ray:
            return futures
        import ray

        try:
            return ray.get(futures)
        except ray.exceptions.RayActorError as e:
            rank = next((r for r, h in enumerate(self.hosts) if h._actor_id.hex() == e.actor_id), "?")
            reason = str(e).strip().splitlines()[-1]  # Ray's last line says why (killed, out of memory...)
            raise WorkerDied(f"worker '{self.name}' rank {rank} died during {what}: {reason}") from e


class Pending:
    """Calls started on a group's ranks (`WorkerGroup.submit`); `result()` waits for them and merges the
    ranks' results (by default: the list of them). Not a coroutine: the ranks run it whether or not it is awaited."""

    def __init__(self, group: WorkerGroup, futures: list, what: str, merge: Callable[[list], Any] = list):
        self.group, self.futures, self.what, self.merge = group, futures, what, merge

    def then(self, merge: Callable[[Any], Any]) -> Pending:
        """The same calls, `merge` applied to what `result()` gave so far."""
        return Pending(self.group, self.futures, self.what, lambda parts: merge(self.merge(parts)))

    def result(self) -> Any:
        return self.merge(self.group._get(self.futures, self.what))


def _node_id(_host) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class Placer:
    """Where a session's Ray worker processes go (`Ray.nodes`): the Ray options of each new group's processes.

    "spread" and "pack" reserve one placement group of `bundles` (one per process, in the order the groups are made)
    and hand its bundles out in that order; a group made again under the same name (a worker replaced) gets its
    bundles back. {role: resource} asks each process of a named role for a little of that resource. `close()`
    frees the reservation."""

    WAIT_S = 60
    """How long a placement group may take to be placed before the session gives up, naming it."""

    def __init__(self, spec: Ray, bundles: list[dict[str, float]]):
        import ray

        self.spec, self.group, self.given, self.next = spec, None, {}, 0
        if isinstance(spec.nodes, dict):
            have = ray.cluster_resources()
            missing = {role: r for role, r in spec.nodes.items() if r not in have}
            if missing:
                custom = sorted(k for k in have if k not in ("CPU", "GPU", "memory", "object_store_memory")
                                and not k.startswith("node:"))
                raise ValueError(f"Ray(nodes={spec.nodes!r}): no node of the cluster has "
                                 f"{', '.join(f'{r!r} (for {role})' for role, r in missing.items())}; its custom "
                                 f"resources: {', '.join(map(repr, custom)) or 'none'}")
        elif spec.nodes != "any":
            self.group = ray.util.placement_group(bundles, strategy=spec.nodes.upper())
            ready, _ = ray.wait([self.group.ready()], timeout=self.WAIT_S)
            if not ready:
                self.close()
                raise ValueError(f"Ray(nodes={spec.nodes!r}): the cluster could not place one process per bundle "
                                 f"{bundles} within {self.WAIT_S} s (each must fit on one node): lower "
                                 f"cpus_per_worker or world_size, or add nodes")

    def options(self, name: str, size: int) -> list[dict]:
        """The Ray actor options of group `name`'s `size` processes."""
        if isinstance(self.spec.nodes, dict):
            resource = self.spec.nodes.get(role_of(name))
            return [{"resources": {resource: 0.001}} if resource else {} for _ in range(size)]
        if self.group is None:
            return [{}] * size
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self.given:
            self.given[name] = list(range(self.next, self.next + size))
            self.next += size
        return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)}
                for i in self.given[name]]

    def close(self) -> None:
        import ray

        if self.group is not None and ray.is_initialized():
            ray.util.remove_placement_group(self.group)
        self.group = None


RANK_LISTS = ("image_inputs",)
"""The list columns a training rank reads: a vision-language model's pixels and grids, per row."""


def _shard(batch: Batch, rows: list[int]) -> Batch:
    """What a training rank gets of `batch`: these rows' tensor columns and `RANK_LISTS`, and the whole-batch values
    (`meta`, a few names and numbers). The text and the examples stay with the driver (no rank reads them, and
    pickling them to a Ray actor costs more than the tensors)."""
    rows_batch = batch if len(rows) == len(batch) else batch[rows]  # rows ascending: all is batch
    return Batch(rows_batch.tensors, {k: rows_batch[k] for k in RANK_LISTS if k in rows_batch}, meta=batch.meta)


def balance(batch: Batch, n: int) -> list[list[int]]:
    """Row indices for `n` ranks with near-equal token counts (longest first, each to the lightest rank),
    each rank's rows in ascending order. Every rank gets at least one row when the batch has n rows."""
    if n == 1:
        return [list(range(len(batch)))]
    if len(batch) < n:
        raise ValueError(f"cannot split {len(batch)} rows across {n} ranks")
    lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])
    ranks: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for i in order:
        r = min(range(n), key=lambda k: (len(ranks[k]) >= -(-len(batch) // n), loads[k], k))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(rows) for rows in ranks]


# ---------------------------------------------------------------------------------- Ray runtime
_OWNED: dict[str, Any] = {"started": False, "sessions": 0, "environ": None}
"""Whether rlbench started the Ray instance of this process, how many sessions use it, and the environment its
worker processes inherit (a private instance's: this process's when it started the instance; None when unknown)."""

WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set in every Ray worker process: an idle OpenMP thread sleeps instead of spinning on a core that another
worker needs."""


def worker_runtime_env(env: dict[str, str] | None = None) -> dict | None:
    """The Ray `runtime_env` that gives a worker `WORKER_ENV` and `env`, or None when its process inherits them
    already (a private instance started from an environment that has them). Ray starts a worker with a runtime_env
    through its runtime-env agent, which costs seconds per worker: about 10 s instead of 3 s for a session's workers."""
    inherited = _OWNED["environ"] or {}
    missing = {k: v for k, v in (WORKER_ENV | (env or {})).items() if inherited.get(k) != v}
    return {"env_vars": missing} if missing else None


def acquire_ray(spec: Ray, cpus_needed: float) -> None:
    """Make Ray usable by a new session: reuse this process's Ray, join a given cluster, or start a
    private local one. Pair with `release_ray()`. ModuleNotFoundError naming the package when Ray is not installed
    (a GPU image without it: benchmarks/gpu/README.md)."""
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        raise ModuleNotFoundError("cluster='ray' needs the ray package, which is not installed here: "
                                  "`pip install 'ray>=2.40'` (a dependency of rlbench that an install with --no-deps "
                                  "leaves out), or use cluster='inline'", name="ray")
    address = spec.address or os.environ.get("RAY_ADDRESS")
    if not address and "ray" not in sys.modules:
        _private_settings()  # Ray reads these settings when imported
    import ray

    if not ray.is_initialized():
        if address:  # a cluster's auth settings come from the environment it was started with
            ray.init(address=address, log_to_driver=False)
        else:
            _start_private(spec.num_cpus or max(os.cpu_count() or 1, int(-(-cpus_needed // 1))))
        _OWNED["started"] = True
    _OWNED["sessions"] += 1


PRIVATE_START_TRIES = 6
"""Starts of a private Ray instance before giving up: Ray gives a new node's raylet 30 s (not configurable) to
register, which a loaded machine (two cores busy with training) can miss; three tries were missed in a row on a
fresh clone's test suite with two more processes busy beside it."""


def _start_private(cpus: int) -> None:
    import ray

    for attempt in range(1, PRIVATE_START_TRIES + 1):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            _OWNED["environ"] = dict(os.environ)
            return
        except Exception as e:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(e) or attempt == PRIVATE_START_TRIES:
                raise
            ray.shutdown()
            warnings.warn(f"the private Ray instance did not start ({e}); starting it again "
                          f"({PRIVATE_START_TRIES - attempt} more tries)", stacklevel=3)


def check_resources(cpus: float, gpus: float, what: str) -> None:
    """ValueError naming `what` when the Ray cluster in use has fewer CPUs or GPUs than asked for (its
    actors would otherwise wait for resources forever)."""
    import ray

    have = ray.cluster_resources()
    for kind, need in (("CPU", cpus), ("GPU", gpus)):
        if need > have.get(kind, 0):
            raise ValueError(f"{what} needs {need:g} {kind}s but the Ray cluster has {have.get(kind, 0):g}: "
                             f"lower world_size or cpus_per_worker, or use a bigger cluster")


def _private_settings() -> None:
    """A private instance listens on 127.0.0.1 only, with token authentication set explicitly: the user's
    RAY_AUTH_* settings if any, else a fresh random token for this process and the Ray processes it starts."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a one-machine instance: loopback only
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    has_token = any(os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    if os.environ["RAY_AUTH_MODE"] == "token" and not has_token and not os.path.exists(
            os.path.expanduser("~/.ray/auth_token")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def release_ray() -> None:
    """A session is done with Ray: when rlbench started it and no session uses it any more, shut it down."""
    import ray

    _OWNED["sessions"] = max(_OWNED["sessions"] - 1, 0)
    if _OWNED["sessions"] == 0 and _OWNED["started"] and ray.is_initialized():
        ray.shutdown()
        _OWNED["started"], _OWNED["environ"] = False, None
