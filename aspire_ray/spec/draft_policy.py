"""When each request drafts and when it verifies (DESIGN.md §1.5, §1.6).

Every step, each decoding request gets one action: DRAFT (one more sparse draft token),
VERIFY (verify its d pending drafts; d = 0 is a plain autoregressive step) or IDLE (only in
synchronized modes, while it waits for the rest of the batch to finish drafting).
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

from aspire_ray.config import SpecConfig

from .acceptance import optimal_gamma, update_alpha
from .cost_model import CostModel

if TYPE_CHECKING:  # spec never imports the engine at run time
    from aspire_ray.engine.request import Request


class Action(enum.Enum):
    DRAFT = "draft"
    VERIFY = "verify"
    IDLE = "idle"


class DraftPolicy:
    def __init__(self, cfg: SpecConfig, cost_model: CostModel, page_size: int) -> None:
        self.cfg = cfg
        self.cost_model = cost_model
        self.page_size = page_size

    def on_admit(self, req: Request) -> None:
        req.alpha = self.cfg.alpha_init
        req.fsm_gamma = self.cfg.gamma

    def sparse_tokens(self, context_len: int) -> int:
        """|S_i| in tokens for a request with this context (DESIGN.md §1.1)."""
        pages = math.ceil(context_len / self.page_size)
        k = self.cfg.sparse_budget(pages)
        return k * self.page_size if pages > k else context_len

    def target(self, req: Request, batch: int) -> int:
        """The draft length this request aims for before verifying."""
        mode = self.cfg.mode
        if mode in ("magicdec", "specattn", "aspire_fixed"):
            return self.cfg.gamma
        if mode == "aspire_fsm":
            return req.fsm_gamma
        # aspire: cost-model optimum, at least gamma_init before the first verification
        ctx = req.num_tokens + len(req.drafts)
        c = self.cost_model.draft_verify_ratio(batch, self.sparse_tokens(ctx), len(req.drafts),
                                               ctx)
        gamma = optimal_gamma(req.alpha, c, self.cfg.d_max)
        if not req.verified_once:
            gamma = max(gamma, self.cfg.gamma_init)
        return gamma

    def decide(self, reqs: list[Request], caps: list[int]) -> list[Action]:
        """reqs: decoding requests; caps[i]: most drafts request i may still hold (stop limits)."""
        if self.cfg.mode == "ar":
            return [Action.VERIFY] * len(reqs)
        batch = len(reqs)
        targets = [min(self.target(r, batch), self.cfg.d_max, cap) for r, cap in zip(reqs, caps,
                                                                                       strict=True)]
        if self.cfg.synchronized:
            if all(len(r.drafts) >= t for r, t in zip(reqs, targets, strict=True)):
                return [Action.VERIFY] * batch
            return [Action.DRAFT if len(r.drafts) < t else Action.IDLE
                    for r, t in zip(reqs, targets, strict=True)]
        return [Action.DRAFT if len(r.drafts) < t else Action.VERIFY
                for r, t in zip(reqs, targets, strict=True)]

    def on_verified(self, req: Request, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        req.verified_once = True
        req.alpha = update_alpha(req.alpha, drafted, accepted, self.cfg.alpha_ema)
        if accepted == drafted:
            req.fsm_gamma = min(req.fsm_gamma + 1, self.cfg.fsm_max)
        else:
            req.fsm_gamma = max(req.fsm_gamma - 1, self.cfg.fsm_min)
