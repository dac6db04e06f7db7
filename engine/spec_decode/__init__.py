"""Speculative decoding: proposers that guess a request's next tokens cheaply, and the
verification that keeps the target model's output distribution exact.

config.py   SpeculativeConfig and the `--speculative-config` JSON parser (no torch)
ngram.py    NgramProposer: prompt lookup, the last n-gram's earlier continuation (no torch)
rejection.py  verification of a step's drafts against the target's logits (torch)
draft_model.py  DraftModel: a small model on the runner proposes after each step (torch)
runner_drafts.py  RunnerDrafts: the scheduler's store of the runner's drafts (no torch)
eagle.py    EagleProposer: an EAGLE-1 head over the target's hidden states (torch)
eagle3.py   Eagle3Proposer: an EAGLE-3 head over three of the target's layers (torch)
backoff.py  DraftBackoff: a request whose drafts keep being rejected stops drafting a while
controller.py  DraftController: a step drafts only where its measured tokens/second say it pays
shadow.py   ShadowDrafts: the acceptance of proposals left unverified (the controller's input)

n-gram: the scheduler proposes (it holds each request's tokens); a draft model: the runner
proposes after each step and the scheduler takes those drafts. Either way the scheduler
schedules 1 + len(drafts) tokens; the runner verifies and returns the accepted drafts plus
one token of its own; the scheduler rolls back the rejected positions (engine.core.scheduler).
"""

from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
