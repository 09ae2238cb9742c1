"""The engine core: the scheduler, cost model, page allocator and step loop of one replica,
stepped in batches, in the replica's own thread or in a driver actor of its own.

``AsyncLLMEngine`` (the replica's side: HTTP, tokenizing, detokenized streams) talks to a core
only through ``step`` (or ``submit`` then ``collect``): one call carries every request admitted
and aborted since the last step, and returns every output of one engine step (never a call per
request or per token). An output carries its request's prompt token ids the first time only
(later ones an empty list: the replica keeps them), so that a step of 64 requests of 16k-token
prompts returns kilobytes, not megabytes, to pickle and unpickle; likewise its output token
ids cross once each (later outputs carry the new ones only).
``EngineCore`` runs it in-process; ``ActorCore`` runs the same class as a Ray actor (the
driver), so that the engine's Python work and, at tp = 1, the GPU forward leave the replica's
GIL to HTTP and streaming (issue 16; vLLM v1's EngineCore / AsyncLLM split is the model). The
driver steps in a loop of its own (``_Driver``): step t + 1 starts as soon as step t ends,
with whatever inputs have arrived by then, and step t's outputs wait in an outbox for the
replica's next call, which takes every step's outputs since its last. The replica's call is
an exchange of channels (its inputs in, the outbox out), never a trigger of a step: the driver
does not wait for the replica to unpickle and deliver outputs, nor for a Ray actor call to be
dispatched, between two steps.

The driver actor is created by the replica and owned by it: when the replica dies, Ray ends
the driver (and the driver's shard workers) with it. When the driver dies, the next ``step``
or ``dead`` call raises or reports it, and the replica fails every open stream.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from aspire_ray.config import EngineConfig
from aspire_ray.outputs import RequestMetrics, RequestOutput
from aspire_ray.process_memory import RSS_KEY, ResidentMemory
from aspire_ray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreFacts:
    """What the HTTP side needs to know of the engine, once."""

    max_model_len: int
    max_request_tokens: int  # most prompt + output tokens a request may have (context, pool)


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class CoreStep:
    """The result of one ``step`` call."""

    outputs: list[RequestOutput]
    rejected: dict[str, BaseException] = field(default_factory=dict)  # adds the engine refused
    busy: bool = False  # unfinished requests remain (step again without waiting for input)
    stats: dict = field(default_factory=dict)  # EngineCore.stats() after the step
    error: str | None = None  # set when the engine became unhealthy (a shard worker died)

    def __reduce__(self):
        """Pickled (a driver's results crossing to the replica) with its outputs as tuples of
        plain values: 64 outputs in ~0.05 ms where the dataclasses (each RequestOutput with its
        RequestMetrics, whose lists grow with the request) took 0.5-1.1 ms, in the driver's Ray
        thread while its step loop schedules the next step (docs/benchmarks.md §9, session 32).
        An unfinished output crosses without its metrics and arrives with an empty
        RequestMetrics: the replica reads a request's metrics when it finishes only
        (``ServingMetrics.on_finished``)."""
        wire = [_OUTPUT_FIELDS(o) for o in self.outputs]
        for i, o in enumerate(self.outputs):
            if not o.finished:
                wire[i] = (*wire[i][:_METRICS], None, *wire[i][_METRICS + 1:])
        return _core_step_from_wire, (wire, self.rejected, self.busy, self.stats, self.error)


# every field of a RequestOutput in order, read at C speed (a field added later crosses too)
_OUTPUT_FIELDS = attrgetter(*(f.name for f in fields(RequestOutput)))
_METRICS = [f.name for f in fields(RequestOutput)].index("metrics")


def _core_step_from_wire(wire: list[tuple], rejected: dict, busy: bool, stats: dict,
                         error: str | None) -> CoreStep:  # fmt: skip
    outputs = []
    for row in wire:
        out = RequestOutput(*row)
        if out.metrics is None:  # unfinished: its metrics stayed in the driver
            out.metrics = RequestMetrics()
        outputs.append(out)
    return CoreStep(outputs, rejected, busy, stats, error)


class EngineCore:
    """An ``LLMEngine`` stepped in batches (not thread-safe: one caller at a time)."""

    # step calls the replica keeps in flight (``AsyncLLMEngine``); in-process a step runs at
    # submit, so one
    pipeline_depth = 1
    # the role of this core's process in the stats' RSS figures (``process_memory``); None:
    # the replica's own process, whose RSS the replica's metrics read themselves
    process_role: str | None = None

    def __init__(self, engine_or_cfg: Any, cpu_threads: int | None = None) -> None:
        from aspire_ray.engine.engine import LLMEngine

        # the driver's torch threads (Ray's default pins one); OpenMP's count is per thread
        self.cpu_threads = None if cpu_threads is None else cpu_threads or os.cpu_count() or 1
        if self.cpu_threads is not None:
            import torch

            torch.set_num_threads(self.cpu_threads)
        if isinstance(engine_or_cfg, EngineConfig):
            engine_or_cfg = LLMEngine(engine_or_cfg)
        self.engine = engine_or_cfg
        # the replica decodes unfinished requests' text from their token ids
        # (``AsyncLLMEngine._deliver``), off the step loop; stop strings and final texts are
        # still the engine's
        self.engine.stream_text = False
        # unfinished requests whose first output was sent -> output tokens sent so far
        self._tokens_sent: dict[str, int] = {}
        self._own_memory = ResidentMemory()

    def facts(self) -> CoreFacts:
        engine = self.engine
        pool = engine.blocks.num_pages * engine.blocks.page_size
        return CoreFacts(engine.max_model_len,
                         min(engine.max_model_len, pool - engine.cfg.spec.d_max))  # fmt: skip

    def stats(self) -> dict:
        return self._current_stats()

    def _current_stats(self) -> dict:
        """``LLMEngine.stats()``, with this process's RSS where it is a process of its own."""
        stats = self.engine.stats()
        if self.process_role is not None:
            stats[RSS_KEY] = {self.process_role: self._own_memory.bytes(),
                              **stats.get(RSS_KEY, {})}  # fmt: skip
        return stats

    def step(self, adds: list[NewRequest], aborts: list[str]) -> CoreStep:
        """Apply the aborts, then the adds, then run one engine step (a step right after an
        abort also tells the workers to drop the request). An add the engine refuses (bad
        prompt or params) is returned in ``rejected``, not raised; a failing step raises.
        A request's first output carries its prompt token ids and its output tokens so far,
        later ones no prompt ids (``[]``) and only the tokens new since the last (the replica
        keeps both, ``AsyncLLMEngine._deliver``): a step's outputs stay kilobytes however long
        the requests' prompts and outputs grow."""
        engine = self.engine
        for request_id in aborts:
            engine.abort_request(request_id)
            self._tokens_sent.pop(request_id, None)
        rejected: dict[str, BaseException] = {}
        for new in adds:
            try:
                engine.add_request(new.request_id, new.prompt, new.params)
            except Exception as exc:  # noqa: BLE001 - a refused request is its caller's error
                rejected[new.request_id] = exc
        outputs = engine.step()
        for out in outputs:
            total = len(out.token_ids)
            sent = self._tokens_sent.pop(out.request_id, None)
            if sent is not None:  # the prompt went with its first output, the tokens before
                out.prompt_token_ids, out.token_ids = [], out.token_ids[sent:]
            else:  # the first: the prompt as a list (the engine's running outputs hold a tuple)
                out.prompt_token_ids = list(out.prompt_token_ids)
            if not out.finished:
                self._tokens_sent[out.request_id] = total
        healthy = getattr(engine, "healthy", True)
        return CoreStep(outputs, rejected, engine.has_unfinished(), self._current_stats(),
                        None if healthy else str(engine.error))  # fmt: skip

    def submit(self, adds: list[NewRequest], aborts: list[str]) -> Any:
        """Start a step -> a handle for ``collect`` (in-process the step runs now)."""
        return self.step(adds, aborts)

    def collect(self, handle: Any) -> CoreStep:
        """The result of a submitted step (steps complete in the order submitted)."""
        return handle

    def dead(self, timeout_s: float = 1.0) -> str | None:
        """Why the engine cannot serve (a dead shard worker), or None: an idle health check."""
        dead = self.engine.executor.dead_ranks(timeout_s)
        if dead:
            ranks = ", ".join(map(str, dead))
            return f"engine unhealthy: tensor-parallel shard worker rank {ranks} died"
        return None

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.engine.shutdown()


class DriverPlacementError(RuntimeError):
    """Ray did not place or start the driver actor in time (resources it can never get)."""


def merge(steps: list[CoreStep]) -> CoreStep:
    """Several steps' results as one, in step order: every output (a request may have several,
    each cumulative), every rejection; busy, stats and error of the last."""
    last = steps[-1]
    return CoreStep([out for st in steps for out in st.outputs],
                    {k: v for st in steps for k, v in st.rejected.items()},
                    last.busy, last.stats, last.error)  # fmt: skip


class _Driver(EngineCore):
    """The driver actor's class: its constructor does nothing, so that Ray placing and starting
    the actor (seconds) is waited for apart from ``start`` building the engine (loading a
    model, converting a GGUF, a calibration sweep: minutes).

    ``start`` also starts the step loop, a thread that alone touches the engine: it takes the
    inbox (inputs of every ``exchange`` since its last step), steps, and puts the result in
    the outbox; it steps again at once while the engine has unfinished requests or inputs
    wait, and sleeps otherwise. A failing step (an exception) or an unhealthy engine stops
    the loop; the next ``exchange`` raises the exception or returns the error."""

    process_role = "driver"

    def __init__(self) -> None:  # the engine comes with start()
        pass

    def start(self, cfg: EngineConfig, cpu_threads: int | None) -> CoreFacts:
        super().__init__(cfg, cpu_threads)
        self._cv = threading.Condition()
        self._inbox: list[tuple[list[NewRequest], list[str]]] = []  # guarded by _cv's lock
        self._outbox: list[CoreStep] = []  # results not yet taken by an exchange
        self._sent = 0  # inbox batches queued, ever
        self._applied = 0  # inbox batches a finished step has applied
        self._busy = False  # the engine had unfinished requests after the last step
        self._failed: BaseException | None = None  # a step raised
        self._ended = False  # the loop returned (a step raised, a worker died, shutdown)
        self._stopped = False
        self._last_stats = self._current_stats()
        self._loop = threading.Thread(target=self._run, name="aspire-driver", daemon=True)
        self._loop.start()
        return self.facts()

    def _run(self) -> None:
        if self.cpu_threads is not None:
            import torch

            torch.set_num_threads(self.cpu_threads)
        while True:
            with self._cv:
                while not (self._inbox or self._busy or self._stopped):
                    self._cv.wait()
                if self._stopped:
                    self._ended = True
                    return
                inbox, self._inbox = self._inbox, []
            adds = [new for batch, _ in inbox for new in batch]
            aborts = [rid for _, batch in inbox for rid in batch]
            try:
                result = self.step(adds, aborts)
            except BaseException as exc:  # noqa: BLE001 - raised by the next exchange
                with self._cv:
                    self._failed, self._ended = exc, True
                    self._cv.notify_all()
                return
            with self._cv:
                self._outbox.append(result)
                self._applied += len(inbox)
                self._busy = result.busy
                self._last_stats = result.stats
                self._ended = result.error is not None  # a worker died: no more steps
                self._cv.notify_all()
                if self._ended:
                    return

    def exchange(self, adds: list[NewRequest], aborts: list[str]) -> CoreStep:
        """Queue inputs for the loop's next step; return every step result since the last
        exchange, merged, once there is at least one and the step that applied these inputs
        is among them (an add's rejection is then known). With nothing to wait for (no
        inputs, the engine idle, or the loop ended by an error) it returns what there is."""
        with self._cv:
            if adds or aborts:
                self._inbox.append((adds, aborts))
                self._sent += 1
                self._cv.notify_all()
            mine = self._sent
            while not self._ended and (self._applied < mine or
                                       (self._busy and not self._outbox)):
                self._cv.wait()
            if self._failed is not None and not self._outbox:
                raise self._failed
            steps, self._outbox = self._outbox, []
        if not steps:
            return CoreStep([], {}, False, self._last_stats, None)
        return merge(steps)

    def stats(self) -> dict:
        return self._last_stats

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._loop.join(timeout=30)
        super().shutdown()


class ActorCore:
    """``EngineCore`` in a Ray actor (the replica's driver), behind the same methods.

    Placement: in the replica's placement group when it has one (bundle ``bundle``; the
    driver's own shard workers are placed in the group's other bundles, as the replica's
    were), else on the replica's node; with the resources given (at tp = 1 on a GPU, the
    GPU). A driver Ray has not started within ``placement_timeout_s`` (its bundle lacks the
    resources it asks for, no node has them) fails the constructor with
    ``DriverPlacementError`` instead of waiting forever."""

    # one exchange in flight: the driver steps on by itself while the replica delivers
    pipeline_depth = 1

    def __init__(self, cfg: EngineConfig, num_cpus: float = 0, num_gpus: float = 0,
                 bundle: int | None = None, cpu_threads: int | None = None,
                 placement_timeout_s: float = 60.0) -> None:  # fmt: skip
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        # one call at a time (EngineCore is not thread-safe); a dead driver is not restarted:
        # the replica fails its streams and Serve replaces the replica
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                                   "max_restarts": 0, "max_concurrency": 1}
        pg = get_current_placement_group()
        if pg is not None and bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True)  # fmt: skip
        elif pg is None:  # beside the replica: the step calls stay on its node
            node = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        self._ray = ray
        self.actor = ray.remote(_Driver).options(**options).remote()
        try:
            try:
                ray.get(self.actor.ping.remote(), timeout=placement_timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError) as e:
                late = isinstance(e, ray.exceptions.GetTimeoutError)
                why = (f"was not started within {placement_timeout_s:g} s" if late
                       else "cannot be placed")
                where = ("on the replica's node" if pg is None else
                         f"in bundle {bundle} of the replica's placement group {pg.bundle_specs}")
                raise DriverPlacementError(
                    f"the engine driver actor (num_cpus={num_cpus}, num_gpus={num_gpus}) {why} "
                    f"{where}; Ray has free {ray.available_resources()}: give the driver a "
                    f"bundle that holds what it asks for (deployment.placement_group_bundles) "
                    f"or set deployment.engine_driver: replica") from None
            self._facts = ray.get(self.actor.start.remote(cfg, cpu_threads))
        except BaseException:
            ray.kill(self.actor)
            raise

    def facts(self) -> CoreFacts:
        return self._facts

    def stats(self) -> dict:
        return self._ray.get(self.actor.stats.remote())

    def step(self, adds: list[NewRequest], aborts: list[str]) -> CoreStep:
        return self.collect(self.submit(adds, aborts))

    def submit(self, adds: list[NewRequest], aborts: list[str]) -> Any:
        """Hand inputs to the driver's loop -> the ObjectRef of its next results (``exchange``:
        the driver runs one call at a time, in the order a caller submitted them)."""
        return self.actor.exchange.remote(adds, aborts)

    def collect(self, handle: Any) -> CoreStep:
        return self._ray.get(handle)

    def dead(self, timeout_s: float = 1.0) -> str | None:
        try:
            return self._ray.get(self.actor.dead.remote(timeout_s), timeout=timeout_s + 1.0)
        except self._ray.exceptions.GetTimeoutError:
            return None  # busy (a long step): a running step notices a dead rank itself
        except Exception as exc:  # noqa: BLE001 - the driver actor itself is gone
            return f"engine unhealthy: the engine driver actor died ({type(exc).__name__})"

    def shutdown(self) -> None:
        try:
            self._ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - dead already, or stuck: kill it either way
            logger.warning("engine driver did not shut down cleanly; killing it")
        self._ray.kill(self.actor)
