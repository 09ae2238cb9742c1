"""tp_size > 1: one shard worker actor per GPU (or CPU slot), all in one placement group.

Placement: inside a Ray Serve replica the replica's own placement group is used (bundle 0 is
the replica, bundles 1..tp the shard workers); elsewhere the executor makes its own
STRICT_PACK group of tp bundles ({GPU: 1} each, or {CPU: 1} on device="cpu") and removes it
on shutdown. Actors take exactly their bundle's resources.

Lifetime: ``shutdown()`` (idempotent) kills the actors and removes an owned group; an executor
garbage-collected without it (``del llm``) does the same through a ``weakref.finalize`` over
``_Shards``, which never refers to the executor, so the next executor's group can be placed.

Per step the plan goes to every rank and rank 0's StepOutput comes back, over one of two
transports (scripts/bench_orchestration.py measures them):
  - "compiled": a Ray Compiled Graph (InputNode -> execute on every rank -> MultiOutputNode),
    which moves plan and outputs through shared-memory channels set up once. Lowest per-step
    cost (tp=2, CPU: ~1.5-2.5 ms vs ~3-4 ms), but its readers poll: each idle rank burns
    ~0.6 of a CPU core, and on a CPU device those cores are the ones computing the model.
  - "plain": ``actor.execute.remote`` per rank and ``ray.wait``/``ray.get``; idle ranks sleep.
"auto": compiled on CUDA (host cores to spare, per-step latency counts), falling back to plain
calls if the graph cannot be compiled; plain on CPU.

Memory: each rank's RSS is asked at most once a second, after a step and never waited for by
one (``shard_memory.py``); the engine's stats carry it (``resident_memory``).

Failure: if any rank dies, raises, or does not answer within ``step_timeout_s``, every actor is
killed (survivors may be blocked in a collective) and ``execute`` raises WorkerDiedError, now
and on every later call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import replace

from aspire_ray.config import EngineConfig
from aspire_ray.plan import ShardInfo, StepOutput, StepPlan

from .base import Executor, WorkerDiedError
from .shard_memory import ShardMemory

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "compiled", "plain")
# start-up waits this long for the shards' first RSS figures (idle actors answer in
# milliseconds); without them the first figures come with a later step
FIRST_MEMORY_SAMPLE_S = 10.0


def check_shardable(cfg: EngineConfig) -> None:
    """Fail before any actor starts if the model cannot be split over tp_size ranks."""
    from aspire_ray.model.arch import ModelArch
    from aspire_ray.tp.group import TPGroup, shard_heads
    from aspire_ray.worker.model_loading import load_hf_config

    arch = ModelArch.from_hf_config(load_hf_config(cfg))
    tp = cfg.tp_size
    shard_heads(arch.num_heads, arch.num_kv_heads, TPGroup(0, tp))  # raises, naming the counts
    if arch.intermediate_size % tp:
        raise ValueError(f"intermediate_size {arch.intermediate_size} cannot be split over "
                         f"tp_size={tp} ranks (tp_size must divide it)")


def ensure_ray(cfg: EngineConfig) -> None:
    """Start (or join, with RAY_ADDRESS) Ray if this process has not yet."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict = {"ignore_reinit_error": True, "include_dashboard": False,
                    "logging_level": logging.WARNING}
    if not os.environ.get("RAY_ADDRESS") and not cfg.device.startswith("cuda"):
        # CPU shards take one CPU bundle each: make sure a small machine can hold them.
        kwargs["num_cpus"] = max(os.cpu_count() or 1, cfg.tp_size)
    ray.init(**kwargs)


class _Placement:
    """The bundles the shard actors go to, and whether this executor owns their group."""

    def __init__(self, cfg: EngineConfig, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group

        tp = cfg.tp_size
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= tp + 1:
            # a Serve replica: bundle 0 is the replica itself, 1..tp are ours
            self.pg, self.first, self.owned = current, 1, False
        else:
            unit = {"GPU": 1} if cfg.device.startswith("cuda") else {"CPU": 1}
            self.pg = placement_group([dict(unit) for _ in range(tp)], strategy="STRICT_PACK")
            self.first, self.owned = 0, True
            ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
            if not ready:
                ray.util.remove_placement_group(self.pg)
                raise RuntimeError(
                    f"tp_size={tp} needs {tp} bundles of {unit} on one node; the cluster "
                    f"({ray.cluster_resources()}) could not place them in {timeout_s:.0f} s")
        self.bundles = [self.pg.bundle_specs[self.first + r] for r in range(tp)]

    def actor_options(self, rank: int, cuda: bool) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from aspire_ray.tp.distributed import NCCL_ENV

        bundle = self.bundles[rank]
        opts = {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.first + rank),
        }
        if cuda:
            opts["runtime_env"] = {"env_vars": dict(NCCL_ENV)}
        return opts

    def release(self) -> None:
        if self.owned:
            from ray.util import remove_placement_group

            remove_placement_group(self.pg)
            self.owned = False


class _Shards:
    """What an executor holds outside this process: the shard actors, the transport to them,
    their placement. ``close`` is idempotent and is also the executor's finalizer."""

    def __init__(self, placement: _Placement) -> None:
        self.placement = placement
        self.actors: list = []
        self.transport: _PlainTransport | _CompiledTransport | None = None

    def close(self, kill_first: bool = False) -> None:
        import ray

        if not ray.is_initialized():
            # ray.shutdown() already ended this driver's actors and placement groups
            self.actors, self.transport, self.placement.owned = [], None, False
            return
        if kill_first:
            # after a failure: survivors may sit in a collective that never completes, and the
            # compiled graph's teardown would wait for them
            self._kill()
        if self.transport is not None:
            # teardown logs each of its steps, and every already-dead actor as an error
            quiet = logging.getLogger("ray.dag.compiled_dag_node")
            level = quiet.level
            quiet.setLevel(logging.CRITICAL if kill_first else logging.WARNING)
            try:
                self.transport.close()
            except Exception as e:
                logger.debug("compiled graph teardown: %s", e)
            finally:
                quiet.setLevel(level)
            self.transport = None
        self._kill()
        self.placement.release()

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


class _PlainTransport:
    name = "plain"

    def __init__(self, actors: list) -> None:
        self.actors = actors

    def run(self, plan: StepPlan, timeout_s: float) -> StepOutput:
        refs = [a.execute.remote(plan) for a in self.actors]
        return _get_all(refs, timeout_s)[0]

    def close(self) -> None:
        pass


class _CompiledTransport:
    name = "compiled"

    def __init__(self, actors: list) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([a.execute.bind(plan) for a in actors])
        self.dag = dag.experimental_compile()

    def run(self, plan: StepPlan, timeout_s: float) -> StepOutput:
        import ray

        return ray.get(self.dag.execute(plan), timeout=timeout_s)[0]

    def close(self) -> None:
        self.dag.teardown()


def _get_all(refs: list, timeout_s: float) -> list:
    """ray.get of every ref, raising on the FIRST failure (a dead rank leaves its peers blocked
    in a collective, so waiting for all of them would hang)."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{len(pending)} shard(s) gave no answer in {timeout_s:.0f} s")
        ray.get(ready)
    return ray.get(refs)


class RayExecutor(Executor):
    def __init__(self, cfg: EngineConfig, transport: str | None = None,
                 step_timeout_s: float | None = None, start_timeout_s: float = 600.0) -> None:
        import ray

        from aspire_ray.worker.ray_worker import ShardWorker

        transport = transport or os.environ.get("ASPIRE_RAY_TRANSPORT", "auto")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.cfg = cfg
        self.step_timeout_s = step_timeout_s or float(
            os.environ.get("ASPIRE_RAY_STEP_TIMEOUT_S", 300))
        self._dead: str | None = None
        check_shardable(cfg)
        ensure_ray(cfg)
        self.placement = _Placement(cfg, start_timeout_s)
        self._shards = _Shards(self.placement)
        # not at interpreter exit: by then Ray's own shutdown ends the job's actors and groups
        self._finalizer = weakref.finalize(self, self._shards.close)
        self._finalizer.atexit = False
        cuda = cfg.device.startswith("cuda")
        actor_cls = ray.remote(ShardWorker)
        try:
            self._shards.actors = [
                actor_cls.options(**self.placement.actor_options(r, cuda)).remote(
                    cfg, r, cfg.tp_size)
                for r in range(cfg.tp_size)]
            self._info = self._start(start_timeout_s)
            self._shards.transport = self._make_transport(transport)
            self._memory = ShardMemory(self.actors)
            self._memory.sample(wait_s=FIRST_MEMORY_SAMPLE_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def actors(self) -> list:
        """The shard actors, rank order ([] once shut down)."""
        return self._shards.actors

    def _start(self, timeout_s: float) -> ShardInfo:
        with _worker_errors():
            host, port = _get_all([self.actors[0].rendezvous.remote()], timeout_s)[0]
            infos = _get_all([a.start.remote(host, port, self.step_timeout_s)
                              for a in self.actors], timeout_s)
        return self._with_all_reduce_cost(self._equalize_pages(infos, timeout_s), timeout_s)

    def _equalize_pages(self, infos: list[ShardInfo], timeout_s: float) -> ShardInfo:
        # page ids are global: every rank holds the smallest rank's page count
        num_pages = min(i.num_pages for i in infos)
        _get_all([a.resize_kv.remote(num_pages) for a in self.actors], timeout_s)
        return replace(infos[0], num_pages=num_pages)

    def _with_all_reduce_cost(self, info: ShardInfo, timeout_s: float) -> ShardInfo:
        """info with the TP group's all-reduce cost, timed on every rank at once (it is a
        collective) for the model's hidden size and dtype; every rank measures the same."""
        costs = self.measure_all_reduce(timeout_s)
        return replace(info, all_reduce_latency=costs[0].latency,
                       all_reduce_per_token=costs[0].per_token)

    def measure_all_reduce(self, timeout_s: float | None = None) -> list:
        """Each rank's ``tp.collective_cost.AllReduceCost`` (rank order), measured now."""
        with _worker_errors():
            return _get_all([a.measure_all_reduce.remote() for a in self.actors],
                            timeout_s or self.step_timeout_s)

    def reconfigure(self, cfg: EngineConfig) -> None:
        """Rebuild every rank's Worker for a new config (same tp_size and device), keeping the
        processes, the process group and the transport: e.g. another spec mode or cache size
        without restarting actors. All request state on the workers is dropped."""
        if (cfg.tp_size, cfg.device) != (self.cfg.tp_size, self.cfg.device):
            raise ValueError(f"reconfigure keeps tp_size and device: have "
                             f"({self.cfg.tp_size}, {self.cfg.device!r}), got "
                             f"({cfg.tp_size}, {cfg.device!r})")
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        with _worker_errors():
            infos = _get_all([a.rebuild.remote(cfg) for a in self.actors], self.step_timeout_s)
        self.cfg = cfg
        # another model may have another hidden size or dtype: its all-reduces are re-timed
        self._info = self._with_all_reduce_cost(self._equalize_pages(infos, self.step_timeout_s),
                                                self.step_timeout_s)

    def _make_transport(self, name: str):
        if name == "plain" or (name == "auto" and not self.cfg.device.startswith("cuda")):
            return _PlainTransport(self.actors)
        try:
            return _CompiledTransport(self.actors)
        except Exception as e:
            if name == "compiled":
                raise
            logger.warning("Ray compiled graph unavailable (%s); using plain actor calls", e)
            return _PlainTransport(self.actors)

    @property
    def transport(self) -> str:
        return self._shards.transport.name

    def set_transport(self, name: str) -> None:
        """Switch between "compiled" and "plain" (benchmarks); no step may be in flight."""
        if name not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
        self._shards.transport.close()
        self._shards.transport = self._make_transport(name)

    def describe(self) -> ShardInfo:
        return self._info

    def execute(self, plan: StepPlan) -> StepOutput:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        try:
            return self._shards.transport.run(plan, self.step_timeout_s)
        except Exception as e:
            dead = self.dead_ranks(timeout_s=2.0)
            what = f"rank {', '.join(map(str, dead))} died" if dead else "failed"
            self._dead = (f"tensor-parallel shard worker {what} in step {plan.step_id} "
                          f"({type(e).__name__}: {_first_line(e)}); the executor is shut down")
            self._close(kill_first=True)
            raise WorkerDiedError(self._dead) from e

    def dead_ranks(self, timeout_s: float = 1.0) -> list[int]:
        """Ranks whose actor is gone. A live rank busy in a step or stuck in a collective just
        does not answer within the timeout, so it is never reported; after the executor has
        shut down (a step found a dead rank) there is nothing left to ask: []."""
        import ray

        if self._dead is not None or not self.actors:
            return []

        refs = {a.ping.remote(): r for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(refs[ref])
        return sorted(dead)

    def resident_memory(self) -> dict[str, int]:
        """Each shard actor's RSS ("shard<rank>"), asked at most once a second and never
        waited for (``ShardMemory``); {} once the executor is shut down."""
        if self._dead is not None or not self.actors:
            return {}
        return self._memory.sample()

    def call_ranks(self, method: str, *args) -> list:
        """Call an actor method on every rank (debugging, tests); one result per rank."""
        return _get_all([getattr(a, method).remote(*args) for a in self.actors],
                        self.step_timeout_s)

    def shutdown(self) -> None:
        """Tear down the transport, kill the actors, remove our placement group (idempotent)."""
        self._close(kill_first=False)

    def _close(self, kill_first: bool) -> None:
        self._shards.close(kill_first)
        self._finalizer.detach()
        self._dead = self._dead or "the executor was shut down"


@contextlib.contextmanager
def _worker_errors():
    """Raise a worker's own exception type and message (e.g. a model it cannot load) instead
    of Ray's wrapper; the wrapper, with the remote traceback, stays attached as the cause."""
    import ray

    try:
        yield
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))
        try:
            err = type(cause)(*cause.args)
        except Exception:
            err = RuntimeError(f"{type(cause).__name__}: {cause}")
        raise err from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
