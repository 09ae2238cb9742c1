"""The server's configuration: the ``args`` of a Serve application, validated at start.

``AppArgs`` = ``engine`` (what model and how to run it) + ``server`` (HTTP behaviour) +
``deployment`` (Ray Serve options). Every section forbids unknown keys, so a typo in a YAML
file fails ``serve run`` with an error naming the field instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from aspire_ray.config import SPEC_MODES, EngineConfig, build_engine_config
from aspire_ray.sampling_params import MAX_STOP_STRINGS

_STRICT = ConfigDict(extra="forbid", frozen=True)

PGStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
SpecMode = Literal[SPEC_MODES]  # config.MODES' names: a typo fails with the list


class EngineArgs(BaseModel):
    """Flat engine settings (the ``LLM(...)`` keywords); None means the engine's default."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = "smollm2-135m-instruct"
    spec_mode: SpecMode = "aspire"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    tp_size: int = Field(1, ge=1)
    load_format: Literal["auto", "hf", "gguf", "dummy"] = "auto"
    attention_backend: str = "auto"
    attention_options: dict[str, Any] = Field(default_factory=dict)
    tokenizer: str | None = None
    seed: int = 0
    # Cost-model calibration at start-up: auto (cached fit or a short sweep), off, force.
    calibrate: Literal["auto", "off", "force"] | None = None
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    page_size: int | None = Field(None, ge=1)
    num_pages: int | None = Field(None, ge=2)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=32)
    max_model_len: int | None = Field(None, ge=1)
    # pages kept free at admission for the running requests' next plan, in tokens (None: one
    # plan's worth, 0: none; SchedulerConfig.admission_headroom_tokens)
    admission_headroom_tokens: int | None = Field(None, ge=0)
    # Every row's logits independent of its step, so that bf16 greedy output of every mode is
    # `ar`'s (EngineConfig.deterministic, issue 18). None: the engine's default (off).
    deterministic: bool | None = None
    # tp_size > 1 on GPUs: every shard replays CUDA graphs with the collectives inside
    # (EngineConfig.tp_cuda_graphs, issue 17). None: the engine's default (off).
    tp_cuda_graphs: bool | None = None
    # Freeze the Python heap once the engine is built, out of the garbage collector's way
    # (EngineConfig.gc_freeze). None: the engine's default (on).
    gc_freeze: bool | None = None
    # Garbage collections that come due while a plan runs wait for the host's waits on the
    # device (EngineConfig.gc_at_waits). None: the engine's default (on).
    gc_at_waits: bool | None = None
    # How the host waits for a graph run's tokens: "event" or "spin" (EngineConfig.device_wait).
    # None: the engine's default ("event").
    device_wait: Literal["event", "spin"] | None = None
    # Speculation knobs of SpecConfig other than the mode (k_min, rho, gamma, d_max, ...).
    spec_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _builds(self) -> EngineArgs:
        # The engine's own validation, run now so that a bad value fails at start.
        try:
            self.to_engine_config()
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        return self

    def to_engine_config(self) -> EngineConfig:
        flat = self.model_dump(exclude={"model", "spec_mode", "spec_options"}, exclude_none=True)
        return build_engine_config(self.model, spec_mode=self.spec_mode, **flat,
                                   **self.spec_options)


class ServerArgs(BaseModel):
    model_config = _STRICT

    # The name clients pass as ``model``; defaults to engine.model.
    served_model_name: str | None = None
    # When set, every endpoint but /health needs ``Authorization: Bearer <api_key>``.
    api_key: str | None = Field(None, min_length=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)  # larger request bodies get a 413
    # Caps on one request (a 400 naming the field when exceeded). None: only the model's
    # context and the KV pool bound prompt + max_tokens (400 context_length_exceeded).
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)  # cap on max_tokens / max_completion_tokens
    max_n: int = Field(16, ge=1)  # choices per request: n * number of prompts
    # The engine matches at most MAX_STOP_STRINGS per request (checked every committed token).
    max_stop_strings: int = Field(MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS)
    # Generation requests (completions, chat) this replica serves at once, streams included;
    # more get a 429. None: no cap here (Serve's deployment.max_ongoing_requests still queues
    # requests beyond it before they reach the replica, so a cap only acts below that).
    max_concurrent_requests: int | None = Field(None, ge=1)
    # torch CPU threads of the engine (in its driver actor, or the replica with
    # engine_driver: replica); None leaves torch's default (Ray sets it from num_cpus), 0
    # means all cores of the machine.
    cpu_threads: int | None = Field(None, ge=0)


class DeploymentArgs(BaseModel):
    """Ray Serve deployment options, passed to ``.options(...)`` (unset ones keep Serve's)."""

    model_config = _STRICT

    name: str = "AspireServer"
    num_replicas: int | Literal["auto"] | None = None
    max_ongoing_requests: int = Field(256, ge=1)  # batched decoding wants many in flight
    max_queued_requests: int | None = None
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: PGStrategy | None = None
    # Where the engine core runs (serving/engine_core.py): "actor", a driver actor the replica
    # starts in its placement group (``driver_placement``; at tp = 1 on a GPU it holds the
    # GPU; the replica keeps HTTP, tokenizing and streaming), or "replica", a thread of the
    # replica itself.
    engine_driver: Literal["actor", "replica"] = "actor"
    # How long a replica waits for Ray to place and start its driver actor (not for the engine
    # to load) before its constructor fails with the resources the driver asked for.
    driver_placement_timeout_s: float = Field(60.0, gt=0)
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _replicas(self) -> DeploymentArgs:
        if self.autoscaling_config is not None and self.num_replicas not in (None, "auto"):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self

    def options(self, engine: EngineArgs) -> dict[str, Any]:
        """The ``.options(...)`` keywords; a tp > 1 engine gets one bundle per shard worker,
        a GPU engine in a driver actor a bundle for the driver's GPU."""
        opts = self.model_dump(exclude_none=True,
                               exclude={"engine_driver", "driver_placement_timeout_s"})
        accel = "GPU" if engine.device.startswith("cuda") else "CPU"
        if engine.tp_size > 1 and self.placement_group_bundles is None:
            # Bundle 0 holds the replica (and its driver actor); the executor puts its workers
            # in the other bundles of the replica's placement group.
            opts["placement_group_bundles"] = [{"CPU": 1}] + [{accel: 1}] * engine.tp_size
            opts.setdefault("placement_group_strategy", "STRICT_PACK")
        elif engine.tp_size == 1 and accel == "GPU" and self.engine_driver == "actor":
            if self.placement_group_bundles is None:  # bundle 1: the driver and its GPU
                opts["placement_group_bundles"] = [{"CPU": 1}, {"GPU": 1}]
                opts.setdefault("placement_group_strategy", "STRICT_PACK")
        elif engine.tp_size == 1 and accel == "GPU" and self.ray_actor_options is None:
            opts["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
        return opts

    def driver_placement(self, engine: EngineArgs) -> dict[str, Any]:
        """The driver actor's bundle of the replica's placement group and its resources
        (``engine_core.ActorCore``): at tp = 1 bundle 1 with that bundle's resources (on a GPU
        its GPU; by default ``[{CPU: 1}, {GPU: 1}]``), at tp > 1 or in a one-bundle group the
        replica's bundle 0 with none (the shard workers take the others); without a group
        (a CPU replica given no bundles) none, beside the replica."""
        bundles = self.options(engine).get("placement_group_bundles")
        if bundles is None:
            return {}
        if engine.tp_size > 1 or len(bundles) == 1:
            return {"bundle": 0}
        return {"bundle": 1, "num_cpus": bundles[1].get("CPU", 0),
                "num_gpus": bundles[1].get("GPU", 0)}  # fmt: skip


class AppArgs(BaseModel):
    """``args:`` of the Serve application (``aspire_ray.serving.deployment:build_app``)."""

    model_config = _STRICT

    engine: EngineArgs = Field(default_factory=EngineArgs)
    server: ServerArgs = Field(default_factory=ServerArgs)
    deployment: DeploymentArgs = Field(default_factory=DeploymentArgs)

    @model_validator(mode="after")
    def _bundles_fit(self) -> AppArgs:
        bundles = self.deployment.placement_group_bundles
        tp = self.engine.tp_size
        gpu = self.engine.device.startswith("cuda")
        if bundles is not None and not gpu and any(b.get("GPU", 0) for b in bundles):
            # a group Ray can never place on CPU-only nodes: the replica would wait forever
            raise ValueError(
                f"deployment.placement_group_bundles {bundles} reserve a GPU but engine.device "
                f"is {self.engine.device!r}: give a CPU engine CPU bundles (e.g. "
                f"[{{CPU: 1}}, {{CPU: 1}}], the replica's and its driver actor's)")
        if self.deployment.engine_driver == "actor" and tp == 1 and gpu:
            replica_gpus = (self.deployment.ray_actor_options or {}).get("num_gpus", 0)
            if replica_gpus:
                raise ValueError(
                    "deployment.ray_actor_options.num_gpus: with engine_driver 'actor' the "
                    "driver actor holds the GPU, not the replica; drop num_gpus (the replica "
                    "gets a placement group with a GPU bundle for its driver) or set "
                    "deployment.engine_driver: replica")
            if bundles is not None and (len(bundles) < 2 or bundles[1].get("GPU", 0) < 1):
                raise ValueError(
                    "deployment.placement_group_bundles: with engine_driver 'actor' on a GPU, "
                    "bundle 1 holds the driver actor and needs {GPU: 1}")
        if self.deployment.engine_driver == "replica" and tp == 1 and gpu:
            actor = self.deployment.options(self.engine).get("ray_actor_options") or {}
            if not actor.get("num_gpus", 0):
                raise ValueError(
                    "deployment.ray_actor_options.num_gpus: with engine_driver 'replica' the "
                    "replica runs the engine and needs the GPU: set num_gpus: 1 (and a GPU in "
                    "bundle 0 of placement_group_bundles, if set), or drop engine_driver")
        if bundles is not None and tp > 1:
            accel = "GPU" if self.engine.device.startswith("cuda") else "CPU"
            workers = sum(1 for b in bundles[1:] if b.get(accel, 0) >= 1)
            if workers < tp:
                raise ValueError(
                    f"deployment.placement_group_bundles has {workers} {accel} bundles after "
                    f"the replica's, but engine.tp_size is {tp}")
        return self

    @property
    def served_name(self) -> str:
        return self.server.served_model_name or self.engine.model
