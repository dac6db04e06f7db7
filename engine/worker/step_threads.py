"""How many CPU threads a step computes on.

On a CPU server the HTTP front end, the engine and (in benchmarks) the client share the
cores. A small step (a few decodes) is a string of short parallel regions; when another
process or thread needs a core, one of the step's threads is descheduled and every region
waits for it at its barrier. Large steps are long compute the front end barely disturbs and
want every core (32 streams: 120 vs 96 tokens/s). So steps of at most ``small_step_tokens``
tokens may leave ``reserved`` threads to the front end (like vLLM's reserved CPU for its front
end on CPU); larger steps use them all. Offline use reserves none.

Whether leaving one pays depends on the machine, so the serving default (``reserved=None``)
measures it on the server's own first small steps: they alternate between all threads and
all but one, and after CALIBRATION_STEPS of each (of the same size) the faster median takes
the small steps (logged when it changes); every RECHECK_STEPS small steps it measures again,
since a shared machine's load moves. The measurement sees what a fixed rule cannot: the
memory's speed on one core against all, and how often the front end takes a core.
- 2-core Zen 4 (2026-12-01, bf16): a 1-row step only a fifth slower on one core; 1 reserved
  won at 2 and 4 streams (78 vs 66, 110 vs 102 tokens/s), both threads at 8 (182 vs 133).
- 2 vCPUs of a Zen 3 EPYC (2026-12-03, a core reads 11-17 GB/s, both 21-24): both threads
  won at one stream, two servers up at once and measured in alternate rounds: TPOT 10.9 vs
  12.4 ms (median of 8 rounds, GGUF), 44 vs 54 ms (6 rounds, bf16). (Before the decode plan
  took a step in one C call, the engine thread won the GIL back from the HTTP thread hundreds
  of times a step, and one thread won here: 43 vs 72 ms.)
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

logger = logging.getLogger("tessera.engine")

SMALL_STEP_TOKENS = 4
CALIBRATION_STEPS = 24  # small steps of one size on each thread count before choosing
RECHECK_STEPS = 4096  # small steps after a choice before measuring again (~40 s of one stream)


class StepThreads:
    def __init__(
        self,
        reserved: int | None,
        small_step_tokens: int = SMALL_STEP_TOKENS,
        calibration_steps: int = CALIBRATION_STEPS,
        recheck_steps: int = RECHECK_STEPS,
    ):
        """reserved: threads small steps leave to the front end; None: measured (see above),
        and measured again every recheck_steps small steps (a shared machine's load moves)."""
        self.total = torch.get_num_threads()
        self.small_step_tokens = small_step_tokens
        self.calibration_steps = calibration_steps
        self.recheck_steps = recheck_steps
        self._current = self.total
        self._auto = reserved is None and self.total > 1
        self._candidates = (self.total - 1, self.total)  # what a measurement compares
        self._step: tuple[int, float] | None = None  # tokens, start (threads: self._current)
        # While measuring: step seconds by step size, then by thread count.
        self._trial: dict[int, dict[int, list[float]]] | None = {} if self._auto else None
        self._since = 0  # small steps since the last choice
        # threads of a small step: None until the first measurement has chosen
        self.small: int | None = None if self._auto else max(1, self.total - max(0, reserved or 0))

    @property
    def measuring(self) -> bool:
        return self._trial is not None

    def for_step(self, num_tokens: int) -> int:
        if num_tokens > self.small_step_tokens:
            return self.total
        if self._trial is None:
            assert self.small is not None
            return self.small
        counts = self._trial.get(num_tokens, {})  # the one with fewer samples goes next
        return min(self._candidates, key=lambda t: len(counts.get(t, ())))

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads (the CPU kernels follow them) for this step."""
        want = self.for_step(num_tokens)
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
        self._step = (num_tokens, time.perf_counter()) if self._auto else None

    def finish(self) -> None:
        """The step applied last has ended: while measuring, count its time; else count it
        towards the next measurement."""
        if self._step is None:
            return
        tokens, start = self._step
        self._step = None
        if tokens > self.small_step_tokens:
            return
        if self._trial is not None:
            self.record(tokens, self._current, time.perf_counter() - start)
            return
        self._since += 1
        if self._since >= self.recheck_steps:
            self._trial = {}

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """One small step's time; chooses once each thread count has enough of one size."""
        if self._trial is None:
            return
        times = self._trial.setdefault(num_tokens, {}).setdefault(threads, [])
        times.append(seconds)
        by_threads = self._trial[num_tokens]
        if any(len(by_threads.get(t, ())) < self.calibration_steps for t in self._candidates):
            return
        medians = {t: statistics.median(by_threads[t]) for t in self._candidates}
        before, self.small = self.small, min(medians, key=medians.__getitem__)
        self._trial, self._since = None, 0
        logger.log(
            logging.INFO if self.small != before else logging.DEBUG,
            "Steps of up to %d tokens run on %d of %d threads from now on: %s (median of %d "
            "%d-token steps each, alternated; --frontend-threads sets it)",
            self.small_step_tokens, self.small, self.total,
            ", ".join(f"{t} thread{'s' * (t > 1)} {medians[t] * 1000:.2f} ms" for t in self._candidates),
            self.calibration_steps, num_tokens,
        )  # fmt: skip
