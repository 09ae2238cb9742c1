"""A synchronized round's verification as one CUDA graph that plans itself (issue 14 items 1-3).

A greedy round (``Worker._execute_chain``, rows with ``verify_after`` = [x]) drafts k tokens per
row on the draft-step graphs, then verifies them: row r's q = k + 1 tokens [x, d_1 .. d_k] at
positions p_r .. p_r + k attend to every page, and the target's argmax at each decides how many
drafts stand. Planned on the host that verification is a StepBatch, a host round trip, and with
a scored page policy an eager refresh layer between two graphs. Here it is one graph per (row
bucket n, q) that plans itself from the draft graphs' device state (``DraftStepGraphs``: each
row's slot and flags; the round's start token and position, copied before the chain; the
chain's drafts, copied after each draft step):

    plan     tokens [n, q], positions, KV slots; every row's full page list (``step_rows``,
             one launch on a GPU); the attention work of rows of q queries
             (``device_plan.decode_attention_items``), as the host plans it
    layers   full lists; with a scored policy the refresh layer also scores pages from each
             row's first and last query, their mean replacing the row's scores (DESIGN.md §1.2,
             as ``StepBatch._plan_scoring`` plans a verify row)
    accept   greedy: a = the longest prefix of drafts equal to the argmax; the row's state moves
             to the next round's start: token argmax[a], position p + a + 1. Sampled rows (a
             graph variant per sampling filter): the argmax becomes each query's choice
             (``sampled_rows.sampled_choices``, from the q of the round's drafts that the draft
             graphs kept, ``DraftStepGraphs.q_round``), which the same acceptance reads

so that a plan's rounds replay back to back with one host sync (``DraftStepGraphs.run_rounds``).
The token rows r * q .. r * q + q - 1 of the bucket's n * q are row r's; tokens past n * q (the
token bucket's padding) write no KV and are read by no one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from aspire_ray.kernels.metadata import PagedKVMeta

from .draft_pages import rescore_first_last
from .page_table import list_capacity
from .sampled_rows import sampled_choices
from .step_rows import accept_rows, plan_rows

if TYPE_CHECKING:
    from aspire_ray.kernels.paged_attention import FixedPlan

_SCORED, _SAMPLED = 2, 4  # DraftStepGraphs' row flag bits: has page scores; samples


class VerifyGraphs:
    def __init__(self, drafts: Any, score: bool) -> None:
        """drafts: the ``DraftStepGraphs`` whose state the verification reads and advances (it
        owns this object: no import back);
        score: the page policy reads scores (verify rows rescore their pages)."""
        self.drafts, self.pieces, self.score = drafts, drafts.pieces, score
        self.model = self.pieces.model
        self.graphs: dict[tuple, object] = {}  # (n, q, sampling variant) -> graph
        self.argmax: dict[tuple, torch.Tensor] = {}  # (n, q, variant) -> int64 [n, q] choices
        self.plans: dict[tuple[int, int], FixedPlan] = {}
        self.steps = 0  # verifications replayed

    def clear(self) -> None:
        """Forget every graph (the tables or the KV pool moved)."""
        self.graphs.clear()
        self.argmax.clear()
        self.plans.clear()

    def fits(self, n: int, q: int) -> bool:
        """Whether bucket n's rows of q queries have a token bucket."""
        return self.pieces.bucket(n * q) is not None

    def ensure(self, n: int, q: int, kv_caches: list[torch.Tensor], variant=None) -> None:
        if (n, q, variant) in self.graphs:
            return
        p, t = self.pieces, self.pieces.bucket(n * q)
        state, start = self.drafts.state[n], self.drafts.start[n]
        with torch.inference_mode():
            p.inputs_for(t, kv_caches)
            fn = lambda: self._step(n, q, t, kv_caches, variant)  # noqa: E731
            graph, out = p.capture_idle(fn, [state, start], "verify")
        self.graphs[n, q, variant], self.argmax[n, q, variant] = graph, out

    def replay(self, n: int, q: int, variant=None) -> torch.Tensor:
        """Verify bucket n's round -> the choices (greedy rows' argmax), int64 [n, q], in the
        graphs' shared pool: copy it before the next replay."""
        self.graphs[n, q, variant].replay()
        self.steps += 1
        return self.argmax[n, q, variant]

    # ---- the captured verification --------------------------------------------------------------
    def _plan(self, n: int, q: int) -> FixedPlan:
        if (n, q) not in self.plans:
            from aspire_ray.kernels.paged_attention import FixedPlan  # imports triton

            attn = self.model.layers[0].self_attn
            self.plans[n, q] = FixedPlan.for_decode(
                n, self.drafts._pool_pages, attn.q_heads, attn.kv_heads, attn.head_dim,
                self.pieces.device, self.drafts.step_graphs.config, q=q)  # fmt: skip
        return self.plans[n, q]

    def _step(self, n: int, q: int, t: int, kv_caches: list[torch.Tensor],
              variant) -> torch.Tensor:  # fmt: skip
        d, p = self.drafts, self.pieces
        ids, pos, slot, flags, top_k, seed = d.state[n]
        start_ids, start_pos = d.start[n]
        table, chain = d.page_table.table, d.chain[n]  # int32 [slots, W]; int64 [D, n]
        ps = kv_caches[0].shape[2]
        inputs = p.inputs[t]
        # row r's tokens [x, d_1 .. d_k] (r * q ..), positions, KV slots and full page list:
        # one launch on a GPU
        rp = plan_rows(dict(slot=slot, flags=flags, x_id=start_ids, x_pos=start_pos), chain,
                       table, d._layout(table.shape[1]), ps, t, inputs,
                       list_capacity(n, table, d._pool_pages), queries=q,
                       verify_all=True, fused=d.fused_rows)  # fmt: skip
        qo, last, rows = rp["qo"], rp["last"], rp["rows"]
        plan = self._plan(n, q)
        plan.load_decode(rp["indptr"], last, ps, q)
        meta = PagedKVMeta(qo, rp["indptr"], rp["indices"], last, ps, fixed_plan=plan)

        layers, lr = self.model.layers, d.refresh_layer
        if not self.score:
            hidden = d.step_graphs.layers(t, 0, len(layers), meta, kv_caches)
        else:
            d.step_graphs.layers(t, 0, lr, meta, kv_caches)
            scale = layers[lr].self_attn.scale
            out, lse = p.backend.attention(p.q[:t], kv_caches[lr], meta, scale, return_lse=True)
            p.attn_out[:t].copy_(out)
            self._rescore(n, q, lse, kv_caches[lr], scale, start_pos, rows[5] > 0, slot,
                          rows[4])  # fmt: skip
            flags.bitwise_or_(rows[5] * _SCORED)
            hidden = d.step_graphs.layers(t, lr + 1, len(layers), meta, kv_caches)
        if variant is None:
            argmax = self.model.greedy_tokens(hidden[: n * q])
        else:  # every live row verifies its round's q - 1 drafts
            logits, argmax = self.model.sampling_logits(hidden[: n * q])  # [n * q, V]
            live = rows[5] > 0
            temperature, top_p = d.fstate[n]
            argmax = sampled_choices(logits, argmax, qo, live.long(),
                                     live.long() * (q - 1), start_pos, chain,
                                     (flags & _SAMPLED) > 0, seed, top_k, temperature, top_p,
                                     variant, d.q_round[n],
                                     coupled=d.coupled)  # fmt: skip
        accept_rows(argmax, inputs[0, : n * q], qo, rows, ids, pos, start_pos, chain,
                    fused=d.fused_rows)  # fmt: skip
        return argmax.view(n, q)

    def _rescore(self, n: int, q: int, lse: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                 start_pos: torch.Tensor, live: torch.Tensor, slot: torch.Tensor,
                 row_slot: torch.Tensor) -> None:  # fmt: skip
        """Rows' page scores from their first and last query (each over the pages it sees)."""
        d = self.drafts
        first = torch.arange(n, device=lse.device) * q
        rescore_first_last(self.pieces.backend, self.pieces.q, lse, kv_cache, scale,
                           d.page_table.table, d.scores, first, first + q - 1, start_pos + 1,
                           start_pos + q, live, slot, row_slot, d._pool_pages,
                           fused=d.fused_rows, tp=self.pieces.model.tp)  # fmt: skip
