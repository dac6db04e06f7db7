"""EAGLE-1 heads: one Llama decoder layer that drafts from the target's own features.

The head's input at position p is fc(concat(embed(x_{p+1}), h_p)): the target's embedding of
the token after p and the target's last-layer hidden state at p (after its final norm); its
output g_p goes through the target's LM head to propose x_{p+2}, and (embed(draft), g) feeds
the next draft. The checkpoint layout is EAGLE-1's: `fc.weight` [H, 2H] (`fc.bias` where the
checkpoint has it) and `layers.0.*` (a Llama decoder layer without input_layernorm); the
embedding and the LM head are the target's (an `embed_tokens` / `lm_head` in the checkpoint
is a copy of them: not read). Its config.json is a Llama config with the target's hidden size.

EagleProposer is DraftModel with another forward: after each step the head reads the step's
kept rows (the target's hidden states and the tokens one ahead, so the last kept row of a
request that sampled carries the emitted token) and writes its K/V there, then k - 1
one-token steps from its own output. Its KV cache is one layer under the target's block ids,
as the draft model's is.

Under tensor parallelism the head runs on the driver alone, built whole (engine.distributed.
single_rank: vLLM's draft_tensor_parallel_size 1); the target's hidden states are whole on
every rank, and TargetVocab holds whole copies of its vocabulary-sharded embedding and LM head
(gathered once at load, every rank taking part), so proposing needs no collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import common_metadata_from_seqs
from engine.distributed import get_tp_size, tp_all_gather
from engine.layers.linear import ReplicatedLinear
from engine.layers.ops import bind_custom_ops
from engine.layers.quantization.unquantized import UnquantizedLMHeadMethod
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.loader import _default_dtype, _weight_files
from engine.models.pipeline import IntermediateTensors
from engine.spec_decode.draft_model import DraftModel
from engine.worker.step_graph import StepInputs, run_step

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.attention.backends.base import AttentionMetadata
    from engine.models.hf_config import HFModelConfig
    from engine.outputs import ScheduledRequest
    from engine.worker.input_batch import CachedRequestState
    from engine.worker.step_graph import StepGraphConfig

_SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "norm.")  # the target's (or unused)


class TargetVocab:
    """The target's token embedding and LM head as a head on one rank uses them: the
    target's own modules at tensor_parallel_size 1; else whole copies of their weights."""

    def __init__(
        self,
        target: nn.Module,
        embed_weight: torch.Tensor | None = None,
        head_weight: torch.Tensor | None = None,
    ) -> None:
        self.target = target
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            return self.target.model.embed_tokens(ids)
        return F.embedding(ids, self.embed_weight)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_weight is not None:
            return F.linear(hidden, self.head_weight).argmax(-1)
        assert self.embed_weight is None, "a gathered vocabulary without the LM head"
        greedy = self.target.greedy_tokens(hidden)
        return greedy if greedy is not None else self.target.compute_logits(hidden).argmax(-1)


def _gather_rows(module: nn.Module) -> torch.Tensor:
    """A vocabulary-sharded table whole (each rank's rows, the last shard's padding cut)."""
    return tp_all_gather(module.weight.data, dim=0)[: module.num_embeddings]


def target_vocab(target: nn.Module, lm_head: bool) -> TargetVocab:
    """The TargetVocab of a head over target. Every rank of a tensor-parallel target must
    call it (the shards' all-gather); lm_head: the head argmaxes through the target's."""
    if get_tp_size() == 1:
        return TargetVocab(target)
    embed = _gather_rows(target.model.embed_tokens)
    head = None
    if lm_head:
        if target.lm_head.tied:
            head = embed
        elif not isinstance(target.lm_head.quant_method, UnquantizedLMHeadMethod):
            raise ValueError(
                "speculative_config: an EAGLE-1 head under tensor parallelism reads the "
                "target's LM head whole, which needs a float LM head (this one is quantized)"
            )
        else:
            head = _gather_rows(target.lm_head)
    return TargetVocab(target, embed, head)


class EagleHead(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, cfg: HFModelConfig, max_position: int, fc_bias: bool):
        super().__init__()
        h = cfg.hidden_size
        self.fc = ReplicatedLinear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, None, 0)])
        del self.layers[0].input_layernorm  # EAGLE-1: the fc output goes in un-normed
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim,
            max(cfg.max_position_embeddings, max_position),
            cfg.rope_theta,
            cfg.rope_scaling,
        )

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.fc(torch.cat((embeds, features), dim=-1))
        layer = self.layers[0]
        rope = self.rotary_emb.lookup(positions, x.dtype)
        h = layer.self_attn(x, rope, meta)
        h, residual = layer.post_attention_layernorm(h, x)
        return layer.mlp(h) + residual

    def attention_layers(self) -> list:
        return [self.layers[0].self_attn.attn]


def head_weight_names(model_dir: Path, what: str) -> dict[str, Path]:
    """Every tensor of the head's checkpoint (a "model." prefix dropped) -> its file."""
    from safetensors import safe_open

    files = _weight_files(model_dir)
    if not files:
        raise ValueError(f"speculative_config: no *.safetensors in the {what} {model_dir}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                names[name.removeprefix("model.")] = file
    return names


def read_tensor(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        key = name if name in f.keys() else f"model.{name}"  # noqa: SIM118
        return f.get_tensor(key)


def load_head_weights(
    head: nn.Module, model_dir: Path, tensors: dict[str, tuple[str, Path]], what: str, layout: str
) -> None:
    """Load tensors (the head's parameter name -> (checkpoint name, file)), q/k/v and
    gate/up into their merged parameters; ValueError for a weight the head has no place
    for (naming layout, the expected one), a wrong shape, or a parameter left unloaded."""
    params = dict(head.named_parameters())
    loaded: dict[str, set] = {}
    for name, (source, file) in tensors.items():
        target, shard = name, None
        for src, (dst, shard_id) in head.packed_modules_mapping.items():
            if f".{src}." in name:
                target, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"speculative_config: {model_dir} is not an {what}: unexpected weight "
                f"{source!r} (expected {layout})"
            )
        tensor = read_tensor(file, source)
        loader = getattr(param, "weight_loader", None)
        if loader is None and param.shape != tensor.shape:
            raise ValueError(
                f"speculative_config: {what} weight {source!r} has shape "
                f"{tuple(tensor.shape)}, the head needs {tuple(param.shape)}"
            )
        try:
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (RuntimeError, ValueError) as e:  # a sliced copy of the wrong shape
            raise ValueError(
                f"speculative_config: {what} weight {source!r} of shape "
                f"{tuple(tensor.shape)} does not fit the head: {e}"
            ) from None
        loaded.setdefault(target, set()).add(shard)
    expected: dict[str, set] = {}
    for dst, shard_id in head.packed_modules_mapping.values():
        expected.setdefault(dst, set()).add(shard_id)
    missing = [
        n
        for n in params
        if loaded.get(n)
        != next((ids for frag, ids in expected.items() if f".{frag}." in n), {None})
    ]
    if missing:
        raise ValueError(f"speculative_config: the {what} {model_dir} lacks weights: {missing[:5]}")


def load_eagle_head(
    model_dir: Path, cfg: HFModelConfig, dtype: torch.dtype, device: torch.device, max_position: int
) -> EagleHead:
    names = head_weight_names(model_dir, "EAGLE head")
    with _default_dtype(dtype), torch.device(device):
        head = EagleHead(cfg, max_position, fc_bias="fc.bias" in names)
    tensors = {
        name: (name, file)
        for name, file in names.items()
        if not name.startswith(_SHARED_PREFIXES) and "rotary_emb.inv_freq" not in name
    }
    load_head_weights(head, model_dir, tensors, "EAGLE-1 head", "fc.weight and layers.0.*")
    bind_custom_ops(head, device)
    return head.eval()


class HeadStage(nn.Module):
    """The head's step in a pipeline stage's form, so that the step graph runs it as one
    (engine.worker.cuda_graph.StageShape): given the target's features as a later stage is
    given the hidden states (no residual), it returns the rows the LM head reads and the
    features the next draft step reads, as a stage returns its hidden states and residual."""

    def __init__(self, proposer: EagleProposer) -> None:
        super().__init__()
        self.proposer = proposer  # not a submodule: the head's weights stay the proposer's

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        given: IntermediateTensors,
    ) -> IntermediateTensors:
        out, g = self.proposer._run_head(input_ids, given.hidden, positions, meta)
        return IntermediateTensors(out, g)


class EagleProposer(DraftModel):
    what = "EAGLE head"

    def __init__(self, target: nn.Module, vocab: TargetVocab, *args, **kwargs) -> None:
        self.target = target
        self.vocab = vocab  # the target's embedding and LM head, as this rank reads them
        super().__init__(*args, **kwargs)
        self._stage = HeadStage(self)

    @property
    def step_module(self) -> nn.Module:
        return self._stage

    def step_graph_config(self, target: StepGraphConfig) -> StepGraphConfig:
        """The draft's, as a stage after the target: given the features (no residual),
        returning both outputs; a feed has at most k + 1 rows a request."""
        return dataclasses.replace(
            super().step_graph_config(target),
            verify_len=self.k + 1,
            first_stage=False,
            last_stage=False,
            stage_residual=False,
        )

    def step_features(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """What the head reads of the target's step: its last hidden states."""
        return hidden

    def _load(
        self, target_config: HFModelConfig, path: str, dtype: torch.dtype, seed: int
    ) -> nn.Module:
        cfg = self.hf_config
        if cfg.hidden_size != target_config.hidden_size:
            raise ValueError(
                f"speculative_config: the EAGLE head {path!r} has hidden size "
                f"{cfg.hidden_size}, the target {target_config.hidden_size}: it must be "
                "trained for this target"
            )
        if target_config.kv_sliding_window() is not None:
            raise ValueError(
                "speculative_config: EAGLE is not supported with a target whose every layer "
                "has a sliding window"
            )
        return load_eagle_head(self.model_dir, cfg, dtype, self.device, self.max_model_len)

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
        assert hidden is not None and last_row is not None, "EAGLE reads the target's step"
        # (start, rows, state, rid, first target row): the step's kept rows of each request
        feeds: list[tuple[int, int, CachedRequestState, str, int]] = []
        proposing: dict[str, int] = {}
        for r in scheduled:
            rid = r.request_id
            state = requests.get(rid)
            if state is None or rid not in last_row:
                continue
            tokens = sampled.get(rid)
            kept = r.num_tokens - len(r.spec_token_ids) + (len(tokens) - 1 if tokens else 0)
            kept = min(kept, len(state.token_ids) - 1 - r.start_pos)  # each row's next token
            if kept <= 0:
                continue
            feeds.append((r.start_pos, kept, state, rid, last_row[rid] - r.num_tokens + 1))
            bonus = len(state.token_ids) - 1
            if tokens and r.start_pos + kept == bonus and wants_drafts(state):
                capacity = state.num_blocks * self.block_size
                m = min(self.k, self.max_model_len - 1 - bonus, capacity - bonus + 1)
                if m > 0:
                    proposing[rid] = m
        if not feeds:
            return {}
        feeds.sort(key=lambda f: (f[1] != 1, f[0] if f[1] == 1 else 0))
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        out_row: dict[str, int] = {}
        for start, count, state, rid, first in feeds:
            ids.extend(state.token_ids[start + 1 : start + 1 + count])
            positions.extend(range(start, start + count))
            rows.extend(range(first, first + count))
            out_row[rid] = len(ids) - 1
        seqs = [(start, count, state.block_table) for start, count, state, _, _ in feeds]
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        features = self._target_features(hidden.index_select(0, index))
        out, g = self._forward_head(ids, features, positions, seqs)
        if not proposing:
            return {}
        order = list(proposing)
        pick = torch.tensor([out_row[rid] for rid in order], device=self.device)
        out, g = out.index_select(0, pick), g.index_select(0, pick)
        drafts: dict[str, list[int]] = {rid: [] for rid in order}
        tokens = self._argmax(out)
        bonus = {rid: len(requests[rid].token_ids) - 1 for rid in order}
        for step in range(1, max(proposing.values()) + 1):
            for rid, t in zip(order, tokens, strict=True):
                drafts[rid].append(t)
            keep = [i for i, rid in enumerate(order) if proposing[rid] > step]
            if not keep:
                break
            keep.sort(key=lambda i: bonus[order[i]])  # decode rows sorted by position
            prev = g.index_select(0, torch.tensor(keep, device=self.device))
            order = [order[i] for i in keep]
            at = [bonus[rid] + step - 1 for rid in order]
            seqs = [(p, 1, requests[rid].block_table) for rid, p in zip(order, at, strict=True)]
            out, g = self._forward_head([drafts[rid][-1] for rid in order], prev, at, seqs)
            tokens = self._argmax(out)
        return drafts

    def _target_features(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's feature input from the target's rows (EAGLE-1: as they are)."""
        return rows

    def _forward_head(
        self, ids: list[int], features: torch.Tensor, positions: list[int], seqs: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows the LM head reads, the features the next draft step reads): the step
        graph's where it takes the step, else the eager forward's."""
        common = common_metadata_from_seqs(seqs, self.block_size)
        step = StepInputs(ids, positions, common, intermediate=IntermediateTensors(features, None))
        out, g = run_step(self.graph, self._stage, step, self._eager_inputs)
        return out, g  # (a stage's IntermediateTensors, unpacked)

    def _run_head(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.model(self.vocab.embed(input_ids), features, positions, meta)
        return g, g  # EAGLE-1: the target's LM head reads the feature it feeds back

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.vocab.argmax(hidden).tolist()
