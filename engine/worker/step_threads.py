"""How many CPU threads a step computes on.

On a CPU server the HTTP front end, the engine and (in benchmarks) the client share the
cores. A small step (a few decodes) is a string of short parallel regions; when another
process or thread needs a core, one of the step's threads is descheduled and every region
waits for it at its barrier. Measured on 2 cores, one stream: 72 ms per token with 2
threads, 43 ms with 1. Large steps are long compute the front end barely disturbs and want
every core (32 streams: 120 vs 96 tokens/s). On a 2-core Zen 4 (2026-12-01, bf16, 1 reserved
vs none): 1 thread wins at 2 and 4 streams (78 vs 66, 110 vs 102 tokens/s), both threads at
8 (182 vs 133: an 8-row step's GEMMs take half the time on two cores, a 1-row step's only a
fifth less, since one core already streams the weights near the memory's speed). So steps
of at most ``small_step_tokens``
tokens leave ``reserved`` threads to the front end (like vLLM's reserved CPU for its
front end on CPU), larger steps use them all. Offline use reserves none.
"""

from __future__ import annotations

import torch

SMALL_STEP_TOKENS = 4


class StepThreads:
    def __init__(self, reserved: int, small_step_tokens: int = SMALL_STEP_TOKENS):
        self.total = torch.get_num_threads()
        self.small = max(1, self.total - max(0, reserved))
        self.small_step_tokens = small_step_tokens
        self._current = self.total

    def for_step(self, num_tokens: int) -> int:
        return self.small if num_tokens <= self.small_step_tokens else self.total

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads (the CPU kernels follow them) for this step."""
        want = self.for_step(num_tokens)
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
