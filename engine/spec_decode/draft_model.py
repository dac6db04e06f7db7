"""DraftModel: a small model that shares the target's tokenizer proposes each request's next
k tokens on the model runner (vLLM v1's draft-model proposer, greedy).

The draft has its own KV cache tensors, addressed by the target's block tables and slot
mapping: a block id holds both models' K/V for the same positions, so the scheduler's
accounting, prefix caching (a cached block holds the draft's K/V too), copy-on-write and
preemption need nothing of their own. The KV budget prices a block at the sum of both.

After each step (propose): one forward over every scheduled request's kept tokens (a prefill
chunk's tokens; for a request that sampled, the step's known tokens from its start plus the
tokens it emitted: the draft's K/V then matches every token the target kept) whose last
row's argmax is draft 1, then k - 1 one-token steps for drafts 2..k. Rejected drafts' K/V is
overwritten by the next step's forward, which starts at the request's first unverified
position. Drafts are argmax (a point mass q), which engine.spec_decode.rejection verifies
exactly at any temperature. A request gets no more drafts than its block table's slots
(the scheduler reserves `num_speculative_tokens` slots ahead where blocks allow) or
max_model_len leave room for.

The draft's forwards go through a step graph of its own where the device has one (CUDA graphs,
engine.worker.cuda_graph, over the draft's weights and cache; built once the cache is bound):
its one-token steps replay the decode graphs, and the feed after a verification step (at most
k + 2 tokens a request: the last verified token, the accepted drafts, the bonus token) a
verification family of k + 2 tokens. An EAGLE head's forwards do too, as a pipeline stage
after its target (engine.spec_decode.eagle.HeadStage).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.backends import select_backend
from engine.attention.metadata import common_metadata_from_seqs
from engine.distributed import get_tp_size, tp_broadcast_object
from engine.models.loader import load_hf_config, load_model, resolve_model
from engine.worker.step_graph import StepInputs, build_eager_inputs, run_step

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.attention.kv_spec import KVCacheSpec
    from engine.models.hf_config import HFModelConfig
    from engine.outputs import ScheduledRequest
    from engine.worker.input_batch import CachedRequestState
    from engine.worker.step_graph import StepGraph, StepGraphConfig

logger = logging.getLogger("tessera.engine")


@dataclass
class _Plan:
    """A step's work for the draft, the same on every rank of a sharded draft: the feed's
    token ids and (start, count, request id) per request in the metadata's order, the drafts
    each proposing request gets, and its bonus token's position."""

    proposing: dict[str, int]
    ids: list[int] = field(default_factory=list)
    feeds: list[tuple[int, int, str]] = field(default_factory=list)
    bonus: dict[str, int] = field(default_factory=dict)


def check_draft_config(target: HFModelConfig, draft: HFModelConfig, path: str) -> None:
    """Refuse a draft model the target cannot verify: another vocabulary, or a target whose
    KV cache drops blocks behind a sliding window (the draft would read dropped blocks)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {path!r} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target {target.vocab_size}: a draft model must "
            "share the target's tokenizer"
        )
    if target.kv_sliding_window() is not None:
        raise ValueError(
            "speculative_config: a draft model is not supported with a target whose every "
            "layer has a sliding window (its KV cache drops the blocks the draft reads)"
        )


class DraftModel:
    def __init__(
        self,
        path: str,
        num_speculative_tokens: int,
        target_config: HFModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        seed: int = 0,
    ) -> None:
        self.k = num_speculative_tokens
        self.device = device
        # split over the tensor-parallel ranks like the target (draft_tensor_parallel_size):
        # every rank holds its shard and runs the step's forwards (follow), else whole on the
        # driver
        self.sharded = False
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_dtype = kv_cache_dtype
        try:
            self.model_dir = resolve_model(path)
            self.hf_config = load_hf_config(self.model_dir)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config: the {self.what.lower()} {path!r}: {e}") from e
        cfg = self.hf_config
        tp = get_tp_size()  # 1 for a draft whole on the driver (built under single_rank)
        if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
            raise ValueError(
                f"speculative_config: the {self.what.lower()} {path!r} has "
                f"{cfg.num_attention_heads} attention and {cfg.num_key_value_heads} KV heads, "
                f"which do not split over {tp} ranks: use draft_tensor_parallel_size 1"
            )
        self.model = self._load(target_config, path, dtype, seed)
        heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        choice = select_backend(
            attention_backend, device, dtype, kv_cache_dtype, kv_heads, cfg.head_dim
        )
        self.backend = choice.backend(block_size, heads, kv_heads, cfg.head_dim, dtype, device)
        for attn in self.model.attention_layers():
            attn.backend = self.backend
        self.num_layers = len(self.model.attention_layers())
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor] = []
        self.graph: StepGraph | None = None  # build_graph, once the cache is bound
        logger.info(
            "%s %s loaded (%d layers, %s): %d tokens proposed per step",
            self.what,
            self.model_dir.name,
            self.num_layers,
            str(dtype).removeprefix("torch."),
            self.k,
        )

    what = "Draft model"
    graphs = True  # whether its forwards may run in a step graph (build_graph)

    def _load(
        self, target_config: HFModelConfig, path: str, dtype: torch.dtype, seed: int
    ) -> torch.nn.Module:
        check_draft_config(target_config, self.hf_config, path)
        return load_model(
            self.model_dir,
            dtype=str(dtype).removeprefix("torch."),
            device=self.device,
            max_position=self.max_model_len,
            seed=seed,
        )

    # -- the KV cache ---------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.backend.kv_cache_spec(self.kv_cache_dtype)

    def kv_block_bytes(self) -> int:
        """Bytes one block takes in the draft's cache (all its layers)."""
        return self.num_layers * self.kv_cache_spec().bytes_per_block

    def init_kv_cache(
        self, num_blocks: int, zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    ) -> None:
        """As many blocks as the target's: the same block ids address both."""
        spec = self.kv_cache_spec()
        kv = spec.allocate(num_blocks, self.device, num_layers=self.num_layers, zeros=zeros)
        self.kv_caches, self.kv_scales = kv.storage, kv.scales
        for i, attn in enumerate(self.model.attention_layers()):
            attn.kv_cache, attn.kv_scales = kv.layer(i)
            attn.kv_spec = spec

    def cache_tensors(self) -> list[torch.Tensor]:
        """What a block copy (copy-on-write of a forked sample) must copy too."""
        return [*self.kv_caches, *self.kv_scales]

    # -- the step graph -------------------------------------------------------------------

    def step_graph_config(self, target: StepGraphConfig) -> StepGraphConfig:
        """The target's step graph configuration for the draft: its backend, sizes and
        ranks, and feeds of up to k + 2 tokens a request (see the module doc)."""
        return dataclasses.replace(
            target,
            backend=self.backend,
            hf_config=self.hf_config,
            num_kv_heads=self.backend.num_kv_heads,
            tp_size=get_tp_size() if self.sharded else 1,
            verify_len=self.k + 2,
            what=self.what.lower(),
        )

    def build_graph(self, graph_type: type[StepGraph], target: StepGraphConfig) -> None:
        """The draft's step graph over its bound cache (None where the device has none)."""
        if self.graph is not None:  # a re-bound cache: the old graph reads the old one
            self.graph.close()
        self.graph = graph_type.build(self.step_module, self.step_graph_config(target))

    @property
    def step_module(self) -> torch.nn.Module:
        """What a step runs (eagerly or in the graph): the draft model."""
        return self.model

    # -- proposing ------------------------------------------------------------------------

    def step_features(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """What propose() reads of the target's step (an EAGLE head's features): none."""
        return None

    def _max_drafts(self, state: CachedRequestState, bonus_pos: int) -> int:
        """Drafts d_1..d_m sit at bonus_pos + 1..m (verified next step: below max_model_len);
        the draft writes K/V at bonus_pos..bonus_pos + m - 1 (inside the block table)."""
        capacity = state.num_blocks * self.block_size
        return max(0, min(self.k, self.max_model_len - 1 - bonus_pos, capacity - bonus_pos))

    @torch.inference_mode()
    def propose(
        self,
        scheduled: list[ScheduledRequest],
        requests: dict[str, CachedRequestState],
        sampled: dict[str, list[int]],
        wants_drafts: Callable[[CachedRequestState], bool],
        hidden: torch.Tensor | None = None,
        last_row: dict[str, int] | None = None,
    ) -> dict[str, list[int]]:
        """Feed the step's kept tokens to the draft and propose up to k drafts for each
        request that sampled (and wants_drafts). `requests` already holds the tokens the
        step emitted (the input batch after append_sampled). hidden, last_row: the target's
        step (an EAGLE head reads them; a draft model does not). A sharded draft's other
        ranks run the same forwards in follow(), from the plan this rank sends them."""
        plan = self._plan(scheduled, requests, sampled, wants_drafts)
        if self.sharded:
            tp_broadcast_object(plan)
        return self._run(plan, requests) if plan is not None else {}

    @torch.inference_mode()
    def follow(self, requests: dict[str, CachedRequestState]) -> None:
        """A sharded draft's rank after the first: the driver's plan for this step (its
        ranks know the step's emitted tokens only from the next step's payload), then the
        same forwards, whose collectives pair with the driver's."""
        plan = tp_broadcast_object(None)
        if plan is not None:
            self._run(plan, requests)

    def _plan(
        self,
        scheduled: list[ScheduledRequest],
        requests: dict[str, CachedRequestState],
        sampled: dict[str, list[int]],
        wants_drafts: Callable[[CachedRequestState], bool],
    ) -> _Plan | None:
        """What the step feeds the draft and how many drafts each request gets, or None."""
        feeds: list[tuple[int, int, CachedRequestState, str]] = []  # (start, count, state, rid)
        proposing: dict[str, int] = {}  # rid -> number of drafts to propose
        for r in scheduled:
            state = requests.get(r.request_id)
            if state is None:
                continue
            tokens = sampled.get(r.request_id)
            capacity = state.num_blocks * self.block_size
            if tokens:
                # kept: the step's tokens up to the last known one, plus what it emitted
                end = r.start_pos + r.num_tokens - len(r.spec_token_ids) + len(tokens)
                end = min(end, len(state.token_ids), capacity)
                m = self._max_drafts(state, end - 1) if end == len(state.token_ids) else 0
                if m > 0 and wants_drafts(state):
                    proposing[r.request_id] = m
            else:
                end = r.start_pos + r.num_tokens
            if end > r.start_pos:
                feeds.append((r.start_pos, end - r.start_pos, state, r.request_id))
        if not feeds:
            return None
        # the attention metadata's order: one-token rows first by position, then the rest
        feeds.sort(key=lambda f: (f[1] != 1, f[0] if f[1] == 1 else 0))
        plan = _Plan(proposing=proposing)
        for start, count, state, rid in feeds:
            plan.ids.extend(state.token_ids[start : start + count])
            plan.feeds.append((start, count, rid))
        plan.bonus = {rid: len(requests[rid].token_ids) - 1 for rid in proposing}
        return plan

    def _run(self, plan: _Plan, requests: dict[str, CachedRequestState]) -> dict[str, list[int]]:
        """The plan's forwards: its feed, whose last row of each proposing request gives
        draft 1, then one-token steps for drafts 2..k."""
        positions: list[int] = []
        last_row: dict[str, int] = {}
        for start, count, rid in plan.feeds:
            positions.extend(range(start, start + count))
            last_row[rid] = len(positions) - 1
        seqs = [(start, count, requests[rid].block_table) for start, count, rid in plan.feeds]
        hidden = self._forward(plan.ids, positions, seqs)
        proposing = plan.proposing
        if not proposing:
            return {}
        order = list(proposing)
        rows = torch.tensor([last_row[rid] for rid in order], device=self.device)
        drafts = {rid: [] for rid in order}
        tokens = self._argmax(hidden.index_select(0, rows))
        pos = plan.bonus  # each request's bonus token's position
        for step in range(1, max(proposing.values()) + 1):
            for rid, t in zip(order, tokens, strict=True):
                drafts[rid].append(t)
            order = [rid for rid in order if proposing[rid] > step]
            if not order:
                break
            by_pos = sorted(order, key=lambda rid: pos[rid])  # decode rows sorted by position
            prev = {rid: drafts[rid][-1] for rid in by_pos}
            at = [pos[rid] + step for rid in by_pos]
            seqs = [(p, 1, requests[rid].block_table) for rid, p in zip(by_pos, at, strict=True)]
            hidden = self._forward([prev[rid] for rid in by_pos], at, seqs)
            tokens = self._argmax(hidden)
            order = by_pos
        return drafts

    def _forward(self, ids: list[int], positions: list[int], seqs: list) -> torch.Tensor:
        step = StepInputs(ids, positions, common_metadata_from_seqs(seqs, self.block_size))
        return run_step(self.graph, self.model, step, self._eager_inputs)

    def _eager_inputs(self, step: StepInputs) -> None:
        build_eager_inputs(step, self.backend, self.device)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        greedy = self.model.greedy_tokens(hidden)
        if greedy is None:
            greedy = self.model.compute_logits(hidden).argmax(-1)
        return greedy.tolist()
