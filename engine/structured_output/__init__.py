"""Grammar-constrained decoding: compiled grammars, per-request matchers, token bitmasks.

backend.py holds the small interface a grammar engine implements (llguidance_backend.py is
the one in use: see BENCHMARKS.md for why); schema_refs.py finds a JSON schema's $ref cycles
and dangling $refs before it is compiled; manager.py compiles off the engine step, caches
compiled grammars, and fills a step's bitmask on a thread while the forward runs; bitmask.py
applies a bitmask to logits with plain torch ops (CPU and GPU samplers alike).
"""

from engine.structured_output.backend import GrammarError, GrammarLimits
from engine.structured_output.manager import RequestGrammar, StructuredOutputManager

__all__ = ["GrammarError", "GrammarLimits", "RequestGrammar", "StructuredOutputManager"]
