"""Draft page policies, one file each (``base.py``: the interface), and the registry that
``config.MODES`` names them from: a new policy is one file here, one ``PAGE_POLICIES`` entry
and the ``config.MODES`` row that names it."""

from __future__ import annotations

from aspire_ray.config import SpecConfig

from .base import PageSelector
from .full import FullPages
from .topk import TopKPages
from .window import StreamingWindow

__all__ = ["PAGE_POLICIES", "FullPages", "PageSelector", "StreamingWindow", "TopKPages",
           "make_selector"]  # fmt: skip

# ``ModeSpec.page_policy`` -> its class
PAGE_POLICIES: dict[str, type[PageSelector]] = {
    "window": StreamingWindow,
    "topk": TopKPages,
}


def make_selector(cfg: SpecConfig) -> PageSelector | None:
    """The draft page policy of a spec mode (``config.MODES``); None for a mode without
    drafts (plain autoregressive decoding)."""
    spec = cfg.mode_spec
    if spec.page_policy == "none":
        return None
    if spec.page_policy not in PAGE_POLICIES:
        raise ValueError(f"page_policy must be one of {tuple(PAGE_POLICIES)} or 'none', "
                         f"got {spec.page_policy!r} (spec mode {cfg.mode!r})")
    policy = PAGE_POLICIES[spec.page_policy]
    if cfg.refresh_while_drafting and not policy.uses_scores:  # the mode's, or draft_refresh
        raise ValueError(f"spec mode {cfg.mode!r} refreshes page scores while drafting, but "
                         f"its page policy {spec.page_policy!r} reads no scores")
    return policy(cfg)
