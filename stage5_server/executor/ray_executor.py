"""The Ray executor: the same ``Worker`` on every rank, as Ray actors that may live on other hosts.

``--distributed-executor-backend ray`` (``LLM(..., distributed_executor_backend="ray")``) joins the
Ray cluster this process belongs to, or ``RAY_ADDRESS``'s; without either it starts a Ray instance of
this host alone, every server of it (GCS, raylet, workers, agents) on the loopback, with no dashboard
(``join_or_start_ray``). It then reserves one bundle per rank, ``{"CPU": 1}`` or ``{"GPU": 1}``, in a
placement group, and starts one actor per bundle. A cluster that cannot place every rank within
``STAGEDSERVE_RAY_PLACEMENT_TIMEOUT`` seconds (default 60) is a clear error naming what was asked and
what the cluster has, not a hang.

The ranks then form one ``torch.distributed`` world as the multiprocess executor's do (TP and PP
collectives over gloo or NCCL), but they cannot meet through a file: they may be on different
hosts. Nor through torch's ``TCPStore``, which listens on every interface of the host that runs it.
They meet through a small Ray actor holding the rendezvous keys (``RendezvousStore``), reached
through Ray's own connections; their data connections bind to ``--distributed-interface`` (the
loopback by default, so a multi-host run must name the interface of the private network between
the hosts).

Ray runs an actor's calls in the order they were sent, which keeps every rank on the same step;
``execute_model_async`` sends a step to every actor and returns, and its ``result()`` is the
driver's answer (TP rank 0 of the last pipeline stage). An actor that dies or raises fails the step
with an error naming the rank.

vLLM: ``vllm/v1/executor/ray_executor.py`` (``RayDistributedExecutor``), ``vllm/v1/executor/ray_utils.py``
(``RayWorkerWrapper``, ``initialize_ray_cluster``: the placement group and its wait).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stage5_server.errors import EngineDeadError
from stage5_server.executor.abstract import Executor, call, start_worker
from stage5_server.parallel.parallel_state import DEFAULT_TIMEOUT_S, resolve_interface

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig
    from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("stagedserve")

PLACEMENT_TIMEOUT_ENV = "STAGEDSERVE_RAY_PLACEMENT_TIMEOUT"
LOOPBACK = "127.0.0.1"
# Ray's switch for clusters of several hosts (on by default on Linux). Set to 0, Ray keeps a loopback node
# address instead of swapping in this host's own (``resolve_ip_for_localhost``), and its gRPC servers then
# listen on the loopback alone rather than on every interface. Read when ``ray`` is imported.
RAY_SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def join_or_start_ray() -> bool:
    """Join the Ray cluster this process belongs to, or ``RAY_ADDRESS``'s (its operator chose where it listens:
    ``ray start --node-ip-address``); else start one for this host alone, listening on the loopback only. True when
    it started one."""
    imported = sys.modules.get("ray")
    if imported is not None and imported.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        ray.init(address=address, log_to_driver=False)
        return False
    # Set while ``ray`` is imported and the instance's processes start (they inherit it), then put back, so that
    # no process this one starts later (a ``ray start`` of its own, say) runs Ray in single-host mode unasked.
    previous = os.environ.get(RAY_SINGLE_HOST_ENV)
    os.environ[RAY_SINGLE_HOST_ENV] = "0"
    try:
        import ray

        if ray.util.get_node_ip_address() != LOOPBACK:
            raise ValueError(f"distributed_executor_backend: Ray was imported before the engine started it, "
                             f"without {RAY_SINGLE_HOST_ENV}=0, so a local instance would listen on every interface; "
                             "set that variable before importing ray, or start Ray yourself and set RAY_ADDRESS")
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, log_to_driver=False)
    finally:
        if previous is None:
            os.environ.pop(RAY_SINGLE_HOST_ENV, None)
        else:
            os.environ[RAY_SINGLE_HOST_ENV] = previous
    return True


class RayWorkerError(EngineDeadError):
    """A Ray worker died or failed; the engine cannot run any more steps."""


class RendezvousKeys:
    """The keys the ranks exchange while they form their process group (a Ray actor)."""

    def __init__(self):
        self.keys: dict[str, bytes] = {}

    def pid(self) -> int:
        return os.getpid()

    def set(self, key: str, value: bytes) -> None:
        self.keys[key] = value

    def get(self, key: str) -> bytes | None:
        return self.keys.get(key)

    def add(self, key: str, amount: int) -> int:
        value = int(self.keys.get(key, b"0")) + amount
        self.keys[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.keys.get(key)
        if current == expected or (current is None and not expected):
            self.keys[key] = desired
            return desired
        return expected if current is None else current

    def has(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)

    def delete(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None

    def count(self) -> int:
        return len(self.keys)


class RendezvousStore(dist.Store):
    """A ``torch.distributed`` store whose keys live in a ``RendezvousKeys`` actor."""

    def __init__(self, actor, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__()
        self.actor, self.timeout_s = actor, timeout_s

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def set(self, key: str, value) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._call("compare_set", key, as_bytes(expected), as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self.timeout_s
        deadline = time.monotonic() + limit
        while not self._call("has", list(keys)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rendezvous: keys {keys} not set within {limit:.0f} s")
            time.sleep(0.01)

    def check(self, keys: list[str]) -> bool:
        return self._call("has", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key)

    def num_keys(self) -> int:
        return self._call("count")


def exit_with_raylet(raylet_pid: int, interval_s: float = 0.2) -> None:
    """A Ray worker's parent is its node's raylet: once that is gone the worker serves nobody, so it exits at
    once rather than when Ray notices (seconds later, tens of seconds on a busy host)."""
    while os.getppid() == raylet_pid:
        time.sleep(interval_s)
    os._exit(1)


def wait_for_exit(pids: list[int], timeout_s: float = 10.0) -> None:
    """Wait until the processes ``pids`` of this host have exited; kill those that have not by ``timeout_s``."""
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        logger.error("Ray worker pid %d did not exit with its raylet; killing it", process.pid)
        process.kill()


class RayWorkerWrapper:
    """One rank inside a Ray actor: builds the ``Worker`` and runs the calls the executor sends."""

    def __init__(self):
        self.worker = None

    def start(self, rank: int, config: EngineConfig, rendezvous, timeout_s: float) -> dict:
        import ray

        device = torch.device("cuda", 0) if config.device.type == "cuda" else torch.device("cpu")  # Ray's GPU
        threads = os.environ.get("OMP_NUM_THREADS")
        store = interface = None
        if config.parallel.world_size > 1:  # named, or this host's VLLM_HOST_IP's, or the loopback
            store = RendezvousStore(rendezvous, timeout_s)
            interface = resolve_interface(config.args["distributed_interface"])
        self.worker = start_worker(config, rank, device, int(threads) if threads else 1,  # the bundle's one CPU
                                   store, interface, timeout_s)
        threading.Thread(target=exit_with_raylet, args=(os.getppid(),), name="raylet-watch", daemon=True).start()
        return {**self.worker.describe(), "node_id": ray.get_runtime_context().get_node_id()}

    def call(self, method: str | Callable, args: tuple):
        return call(self.worker, method, args)

    def stop(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RayPendingStep:
    def __init__(self, executor: RayExecutor, refs: list):
        self.executor, self.refs = executor, refs

    def result(self) -> ModelRunnerOutput:
        return self.executor.gather(self.refs, "execute_model")[self.executor.driver_rank]


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, timeout_s: float = DEFAULT_TIMEOUT_S):
        if importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend: 'ray' needs Ray (pip install ray)")
        self.started_ray = join_or_start_ray()  # before ``import ray``: it may set how Ray binds
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = config.parallel
        self.world_size = world_size = parallel.world_size
        self.driver_rank = world_size - parallel.tensor_parallel_size
        self.failure: RayWorkerError | None = None
        resource = "GPU" if config.device.type == "cuda" else "CPU"
        self.placement_group = group = placement_group([{resource: 1}] * world_size, strategy="PACK")
        wait_s = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "60"))
        ready, _ = ray.wait([group.ready()], timeout=wait_s)
        if not ready:
            self.shutdown()  # the group, and a Ray instance this executor started
            raise ValueError(f"distributed_executor_backend: the Ray cluster cannot place {world_size} workers of "
                             f"{{'{resource}': 1}} within {wait_s:.0f} s (TP {parallel.tensor_parallel_size} x PP "
                             f"{parallel.pipeline_parallel_size}); it has {ray.cluster_resources().get(resource, 0):g} "
                             f"{resource} in all, {ray.available_resources().get(resource, 0):g} free")
        actor_class = ray.remote(RayWorkerWrapper)
        self.rendezvous = ray.remote(RendezvousKeys).options(num_cpus=0).remote()
        self.actors = [actor_class.options(
            num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote() for rank in range(world_size)]
        try:
            self.workers = self.gather([actor.start.remote(rank, config, self.rendezvous, timeout_s)
                                        for rank, actor in enumerate(self.actors)], "start-up")
            self.actor_pids = [*self.pids, ray.get(self.rendezvous.pid.remote())]
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray executor: %d ranks (TP %d x PP %d) on %d node(s): %s", world_size,
                    parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                    len({w["node_id"] for w in self.workers}),
                    ", ".join(f"rank {w['rank']} node {w['node_id'][:8]} stage {w['stage']}" for w in self.workers))

    @property
    def pids(self) -> list[int]:
        return [w["pid"] for w in self.workers]

    def gather(self, refs: list, what: str) -> list:
        """Every rank's answer to one call, in rank order; a rank's failure fails the engine."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.failure is not None:
            raise RayWorkerError(f"the Ray engine is down: {self.failure}")
        try:
            return ray.get(refs, timeout=None)
        except (RayActorError, RayTaskError) as exc:
            rank = next((r for r, ref in enumerate(refs) if _failed(ref)), None)
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            self.failure = RayWorkerError(f"Ray worker failed during {what}: rank {rank}: {cause}")
            logger.error("%s; stopping all %d ranks", self.failure, self.world_size)
            self.shutdown()
            raise self.failure from exc

    def collective_rpc(self, method: str | Callable, *args) -> list:
        return self.gather([actor.call.remote(method, args) for actor in self.actors], str(method))

    def execute_model_async(self, step: SchedulerOutput) -> RayPendingStep:
        if self.failure is not None:
            raise RayWorkerError(f"the Ray engine is down: {self.failure}")
        return RayPendingStep(self, [actor.call.remote("execute_model", (step,)) for actor in self.actors])

    def shutdown(self) -> None:
        """Kill the actors and give the placement group back. A Ray instance this executor started stops too, and
        its worker processes are waited for, so none outlives the engine; a cluster it joined stays up."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.failure is None:
            self.failure = RayWorkerError("it was shut down")
        for actor in [*getattr(self, "actors", []), getattr(self, "rendezvous", None)]:
            if actor is not None:
                ray.kill(actor)
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if getattr(self, "started_ray", False):
            self.started_ray = False
            ray.shutdown()  # its GCS, raylet and agents; each worker exits with its raylet (``exit_with_raylet``)
            wait_for_exit(getattr(self, "actor_pids", []))  # this host's: the engine outlives them all


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:  # raised (or not done): the first such rank is named
        return True
