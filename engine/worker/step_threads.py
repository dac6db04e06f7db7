"""How many CPU threads a step computes on.

On a CPU server the HTTP front end, the engine and (in benchmarks) the client share the
cores. A small step (a few decodes) is a string of short parallel regions; when another
process or thread needs a core, one of the step's threads is descheduled and every region
waits for it at its barrier. Large steps are long compute the front end barely disturbs and
want every core (32 streams: 120 vs 96 tokens/s). So steps of at most ``small_step_tokens``
tokens may leave ``reserved`` threads to the front end (like vLLM's reserved CPU for its front
end on CPU); larger steps use them all. Offline use reserves none.

Whether leaving one pays depends on the machine and the step's size, so the serving default
(``reserved=None``) measures it on the server's own steps, in two bands of sizes (1-4 and
5-16 tokens) decided apart: a band's first steps alternate between all threads and all but
one, and after CALIBRATION_STEPS of each (of the same size) the faster median takes the
band's steps (logged when it changes); every RECHECK_STEPS of the band's steps it measures
again, since a shared machine's load moves. The measurement sees what a fixed rule cannot: the
memory's speed on one core against all, and how often the front end takes a core.
- 2-core Zen 4 (2026-12-01, bf16): a 1-row step only a fifth slower on one core; 1 reserved
  won at 2 and 4 streams (78 vs 66, 110 vs 102 tokens/s), both threads at 8 (182 vs 133).
- 2 vCPUs of a Zen 3 EPYC (2026-12-03, a core reads 11-17 GB/s, both 21-24): both threads
  won at one stream, two servers up at once and measured in alternate rounds: TPOT 10.9 vs
  12.4 ms (median of 8 rounds, GGUF), 44 vs 54 ms (6 rounds, bf16). (Before the decode plan
  took a step in one C call, the engine thread won the GIL back from the HTTP thread hundreds
  of times a step, and one thread won here: 43 vs 72 ms.)
- 2 vCPUs of a Zen 5 EPYC (2026-12-03, GGUF): one thread won 1-token steps (6.4-6.9 vs
  11.6-13.0 ms) and 8-token steps (12.35 vs 13.67 ms); with the 5-16 band measured too
  (before, steps of 5+ tokens took every thread) 8 streams ran 462 vs 394 tokens/s (two
  servers up at once, alternate rounds: faster in 8 of 8).
The Zen 4 and Zen 5 answers above were measured while the server held two OpenMP teams (the
model loaded on one thread, stepped on another; see AsyncEngine.create), which made each
parallel region of a two-thread step a futex wake-up: they may differ now.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

logger = logging.getLogger("tessera.engine")

SMALL_STEP_TOKENS = 4  # a fixed --frontend-threads reserves threads from steps this small
BANDS = (SMALL_STEP_TOKENS, 16)  # auto: steps of 1-4 tokens, then 5-16, each measured alone
CALIBRATION_STEPS = 24  # small steps of one size on each thread count before choosing
RECHECK_STEPS = 4096  # a band's steps after a choice before measuring it again (~40 s at 1 stream)


class StepThreads:
    def __init__(
        self,
        reserved: int | None,
        bands: tuple[int, ...] = BANDS,
        calibration_steps: int = CALIBRATION_STEPS,
        recheck_steps: int = RECHECK_STEPS,
    ):
        """reserved: threads steps of up to bands[0] tokens leave to the front end; None:
        measured for each band of step sizes (see above), and measured again every
        recheck_steps steps of the band (a shared machine's load moves)."""
        self.total = torch.get_num_threads()
        self._auto = reserved is None and self.total > 1
        self.bands = bands if self._auto else bands[:1]
        self.calibration_steps = calibration_steps
        self.recheck_steps = recheck_steps
        self._current = self.total
        self._candidates = (self.total - 1, self.total)  # what a measurement compares
        self._step: tuple[int, float] | None = None  # tokens, start (threads: self._current)
        # Bands being measured: step seconds by step size, then by thread count.
        self._trial: dict[int, dict[int, dict[int, list[float]]]] = (
            {b: {} for b in self.bands} if self._auto else {}
        )
        self._since = dict.fromkeys(self.bands, 0)  # a band's steps since its last choice
        # each band's threads: None until its first measurement has chosen
        fixed = None if self._auto else max(1, self.total - max(0, reserved or 0))
        self.small: dict[int, int | None] = dict.fromkeys(self.bands, fixed)

    @property
    def measuring(self) -> bool:
        return bool(self._trial)

    def band(self, num_tokens: int) -> int | None:
        """The band (its largest step) a step of this many tokens falls in; None: all threads."""
        return next((b for b in self.bands if num_tokens <= b), None)

    def for_step(self, num_tokens: int) -> int:
        band = self.band(num_tokens)
        if band is None:
            return self.total
        trial = self._trial.get(band)
        if trial is None:
            threads = self.small[band]
            assert threads is not None
            return threads
        counts = trial.get(num_tokens, {})  # the one with fewer samples goes next
        return min(self._candidates, key=lambda t: len(counts.get(t, ())))

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads (the CPU kernels follow them) for this step."""
        want = self.for_step(num_tokens)
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
        self._step = (num_tokens, time.perf_counter()) if self._auto else None

    def finish(self) -> None:
        """The step applied last has ended: while its band is measured, count its time; else
        count it towards the band's next measurement."""
        if self._step is None:
            return
        tokens, start = self._step
        self._step = None
        band = self.band(tokens)
        if band is None:
            return
        if band in self._trial:
            self.record(tokens, self._current, time.perf_counter() - start)
            return
        self._since[band] += 1
        if self._since[band] >= self.recheck_steps:
            self._trial[band] = {}

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """One step's time; chooses for its band once each thread count has enough steps of
        one size."""
        band = self.band(num_tokens)
        trial = self._trial.get(band)
        if trial is None:
            return
        by_threads = trial.setdefault(num_tokens, {})
        by_threads.setdefault(threads, []).append(seconds)
        if any(len(by_threads.get(t, ())) < self.calibration_steps for t in self._candidates):
            return
        medians = {t: statistics.median(by_threads[t]) for t in self._candidates}
        before, self.small[band] = self.small[band], min(medians, key=medians.__getitem__)
        del self._trial[band]
        self._since[band] = 0
        low = 1 + max((b for b in self.bands if b < band), default=0)
        logger.log(
            logging.INFO if self.small[band] != before else logging.DEBUG,
            "Steps of %d-%d tokens run on %d of %d threads from now on: %s (median of %d "
            "%d-token steps each, alternated; --frontend-threads sets it)",
            low, band, self.small[band], self.total,
            ", ".join(f"{t} thread{'s' * (t > 1)} {medians[t] * 1000:.2f} ms" for t in self._candidates),
            self.calibration_steps, num_tokens,
        )  # fmt: skip
