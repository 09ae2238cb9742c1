"""A worker stand-in for engine tests without a model: it checks every plan the way a worker
would use it, answers token 0 everywhere, accepts drafts as told and reports a step time from a
known cost model over the engine's own features."""

from __future__ import annotations

import math
from collections.abc import Callable

from aspire_ray.executor.base import Executor
from aspire_ray.plan import RowKind, RowResult, ShardInfo, StepOutput, StepPlan, StepTimings
from aspire_ray.spec.draft_policy import DraftPolicy
from aspire_ray.worker.async_runs import AsyncTrack

TRUE = (2e-3, 5e-5, 3e-7)  # b_model, b_tok, b_kv the fake device "measures" by default


class FakeExecutor(Executor):
    """seconds(n_tokens, kv_tokens) -> the step time (default: the three-term model TRUE);
    ``accept``: verify rows accept all their drafts (True) or none (False); ``info``: extra
    describe() fields (e.g. the start-up measurements)."""

    def __init__(
        self,
        cfg,
        device_name: str = "fake-gpu",
        num_layers: int = 4,
        seconds: Callable[[int, float], float] | None = None,
        info: dict | None = None,
    ) -> None:
        self.cfg = cfg
        self.device_name = device_name
        self.num_layers = num_layers
        self.info = info or {}
        self.policy = DraftPolicy(cfg.spec, None, cfg.cache.page_size, num_layers,
                                  self.info.get("query_tile_tokens"))  # fmt: skip
        self.seconds = seconds or (lambda n, kv: TRUE[0] + TRUE[1] * n + TRUE[2] * kv)
        self.accept = True
        self.tables: dict[str, list[int]] = {}
        self.calls = 0

    def describe(self) -> ShardInfo:
        return ShardInfo(**{
            "num_pages": 600,
            "num_layers": self.num_layers,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "eos_token_ids": (),
            "refresh_layer": 2,
            "device_name": self.device_name,
            **self.info,
        })  # fmt: skip

    def execute(self, plan: StepPlan) -> StepOutput:
        self.calls += 1
        for rid in plan.dropped_req_ids:
            del self.tables[rid]
        for rid in plan.new_requests:
            assert rid not in self.tables
            self.tables[rid] = []
        assert len({r.req_id for r in plan.rows}) == len(plan.rows), "two rows of one request"
        results = []
        for row in plan.rows:
            bt = self.tables[row.req_id]
            del bt[row.pages_keep :]
            bt.extend(row.pages_new)
            assert math.ceil(row.context_len / self.cfg.cache.page_size) <= len(bt)
            if row.kind == RowKind.VERIFY and row.num_steps > 1:  # an ar decode chain
                results.append(RowResult(row.req_id, row.kind, [0] * row.num_steps))
            elif row.async_gamma is not None:
                results.append(self._async(row))
            elif row.kind == RowKind.VERIFY:
                assert row.num_tokens == row.num_drafts + 1
                results.append(self._verify(row))
            elif row.kind == RowKind.DRAFT:  # a chain's drafts; its rounds' verifications
                results.append(self._draft(row))
            elif row.sample:
                results.append(RowResult(row.req_id, row.kind, [0]))
            else:
                results.append(RowResult(row.req_id, row.kind, []))
        if plan.rows and plan.rows[0].async_gamma is not None:  # its steps' mean, times them
            seconds = plan.rows[0].num_steps * self.seconds(*self.policy.run_features(plan.rows))
        else:
            seconds = self.seconds(*self.policy.step_features(plan.rows))
        return StepOutput(plan.step_id, results, StepTimings(forward=seconds, total=seconds))

    def _verify(self, row) -> RowResult:
        a = row.num_drafts if self.accept else 0
        return RowResult(row.req_id, RowKind.VERIFY, [0] * (a + 1), a)

    def _async(self, row) -> RowResult:
        """An asynchronous run, step by step as the worker tracks it (drafts are token 0; the
        target agrees with all of them or none)."""
        track = AsyncTrack(row)
        for step, d in enumerate(track.kinds):
            track.take(step, [0] if d < 0 else [0] * (d + 1) if self.accept else [1] + [0] * d)
        return track.result()

    def _draft(self, row) -> RowResult:
        """num_steps drafts; with verify_after each of num_rounds rounds verified too."""
        rounds = []
        for _ in range(row.num_rounds if row.verify_after is not None else 1):
            res = RowResult(row.req_id, row.kind, [0] * row.num_steps)
            if row.verify_after is not None:
                res.verified = self._verify(row.verify_row(res.tokens))
                if row.num_rounds > 1:
                    row = row.next_round(res.verified.tokens)
            rounds.append(res)
        rounds[0].rounds = rounds[1:]
        return rounds[0]
