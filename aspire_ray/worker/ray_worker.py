"""One tensor-parallel rank as a Ray actor: a Worker (model shard + KV shard) in its own process.

Life of an actor, driven by ``aspire_ray.executor.ray_executor.RayExecutor``:
  1. rank 0 ``rendezvous()``: opens the process-group store on a free port, returns (host, port);
  2. every rank ``start(host, port)``: joins the group, builds its Worker, returns ``describe()``;
  3. every rank ``resize_kv(n)``: the pool shrinks to the smallest rank's page count (page ids
     are global, one block table serves all ranks);
  4. ``execute(plan)`` once per step on every rank (plain actor calls or a compiled graph).
Only plans, outputs and small dicts cross the actor boundary.
"""

from __future__ import annotations

import time

import torch

from aspire_ray.config import EngineConfig
from aspire_ray.plan import StepOutput, StepPlan
from aspire_ray.process_memory import resident_bytes
from aspire_ray.tp import distributed

from .worker import Worker


class ShardWorker:
    def __init__(self, cfg: EngineConfig, rank: int, size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.size = size
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's one GPU: it is always cuda:0 here
        cuda = cfg.device.startswith("cuda")
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.worker: Worker | None = None
        self._store = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: open the store on a free port of this node; returns (host, port)."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store = distributed.open_store(host, self.size)
        return host, self._store.port

    def start(self, host: str, port: int, timeout_s: float) -> dict:
        """Join the TP group, build the model shard and its KV pool; returns describe()."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        tp = distributed.init_group(distributed.backend_for(self.device), self.rank, self.size,
                                    host, port, store=self._store, timeout_s=timeout_s)
        self.worker = Worker(self.cfg, tp=tp, device=str(self.device))
        return self.worker.describe()

    def rebuild(self, cfg: EngineConfig) -> dict:
        """A fresh Worker for a new config in the same process group; returns describe()."""
        tp = self.worker.tp
        self.worker = None  # free the old model and pool first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cfg = cfg
        self.worker = Worker(cfg, tp=tp, device=str(self.device))
        return self.worker.describe()

    def resize_kv(self, num_pages: int) -> int:
        """Reallocate the KV pool with ``num_pages`` pages (no request may be live)."""
        w = self.worker
        if w.requests:
            raise RuntimeError("resize_kv with live requests would lose their KV")
        first = w.kv_caches[0]
        if first.shape[0] != num_pages:
            shape, dtype = (num_pages, *first.shape[1:]), first.dtype
            # free the old pool before allocating: it may fill most of the GPU
            del first
            w.kv_caches = []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            w.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                           for _ in range(w.arch.num_layers)]
        return w.num_pages

    def measure_all_reduce(self):
        """The TP group's all-reduce cost for this model's activations (a collective: every
        rank at once); ``tp.collective_cost.AllReduceCost``."""
        from aspire_ray.tp.collective_cost import measure_all_reduce
        from aspire_ray.worker.model_loading import DTYPES

        w = self.worker
        return measure_all_reduce(w.tp, w.arch.hidden_size, DTYPES[w.cfg.dtype], self.device)

    def execute(self, plan: StepPlan) -> StepOutput | None:
        """Run the step; only rank 0's output goes back (every rank computes the same tokens)."""
        out = self.worker.execute(plan)
        return out if self.rank == 0 else None

    def page_scores(self) -> dict[str, list[float] | None]:
        """Debug: each live request's refresh-layer page scores on this rank."""
        return {rid: None if r.scores is None else r.scores.tolist()
                for rid, r in self.worker.requests.items()}

    def graph_counters(self) -> dict[str, int]:
        """Debug: this rank's graph replays and early starts (``Worker.graph_counters``)."""
        return self.worker.graph_counters()

    def graph_clock(self, start: bool) -> dict | None:
        """Debug: start this rank's graph clock, or stop it and return what it recorded
        (``Worker.graph_clock``)."""
        return self.worker.graph_clock(start)

    def ping(self) -> int:
        return self.rank

    def resident_memory(self) -> int:
        """This process's RSS in bytes (``RayExecutor.resident_memory``, once a second)."""
        return resident_bytes()

    def cpu_seconds(self) -> float:
        """CPU time of this process so far, all threads (benchmarks: the idle cost of a
        transport that polls)."""
        return time.process_time()

    def stop(self) -> None:
        distributed.destroy_group()
