"""Step times outside the profiler: what the analysis calibrates the profiled host time against.

A step runs from the return of one `cap.step()` (or the start of the block) to the next `cap.step()` call,
so the profiler's own start and stop between steps are not in it. Its time is the GPU-side time between
two CUDA events recorded there (the step as the GPU lives it, whether the host or the GPU bounds it), or
the wall-clock time without CUDA. Only steps the profiler did not run in count; the first step of the
block is left out as warm-up when a later one was timed.

A step the GPU bounds hides its host time, which the analysis then cannot calibrate: with `host_steps=k`, the
k unprofiled steps after the first each start on an idle GPU (a synchronize) and are timed on the host's clock
until the next `cap.step()`, the host's own time for the step (an upper bound where the step itself waits on
the GPU). Those steps are left out of the step times. The fastest of them is the host's time: noise (a garbage
collection, a descheduled thread) only adds to a host's step, and on the H100 one such sample of a training
step ranged 26-37 ms over nine tries (benchmarks/results/predict_vs_ab.md, 2026-11-27).
"""
import statistics
import time

import torch


def host_alone_steps(wait: int) -> int:
    """How many of `wait` unprofiled steps to time on the host alone: up to 3 after the warm-up one, leaving
    at least as many to time the loop's step."""
    return max(0, min(3, (wait - 1) // 2))


class StepTimer:
    def __init__(self, host_steps: int = 0):
        # per step: None (profiled, or timed on the host alone), (start seconds, start event, end seconds,
        # end event) of an unprofiled one, or its µs once settled
        self.steps: list = []
        self.host_steps_us: list[float] = []  # host-clock times of the steps started on an idle GPU
        self._open: tuple | None = None
        self._host_open: float | None = None
        self._host_steps = host_steps
        self._unprofiled_begun = 0
        self._cuda_timed = False  # some step was timed by CUDA events

    def begin(self, profiled: bool) -> None:
        """A step starts; it is timed when the profiler will not run in it."""
        self._open = self._host_open = None
        if profiled:
            return
        self._unprofiled_begun += 1
        if 2 <= self._unprofiled_begun <= 1 + self._host_steps and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            self._host_open = time.perf_counter()
            return
        self._open = (time.perf_counter(), self._event())

    def end(self) -> bool:
        """The step ends; True where it was a loop step timed outside the profiler, the warm-up one left out."""
        if self._host_open is not None:
            self.host_steps_us.append((time.perf_counter() - self._host_open) * 1e6)
            self._host_open = None
            self.steps.append(None)  # not a loop's step: left out of the step times
        elif self._open is not None:
            self.steps.append((*self._open, time.perf_counter(), self._event()))
            self._cuda_timed = self._cuda_timed or self.steps[-1][1] is not None
            self._open = None
            return self._unprofiled_begun > 1
        else:
            self.steps.append(None)  # a profiled step: counted, not timed
        return False

    @staticmethod
    def _event():
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        """Read the timed steps' CUDA events now, as the profiler is about to record: read inside a recorded
        step (capture's metadata is written there), their synchronize calls would be in the user's trace."""
        self.steps = [self._us(step) if isinstance(step, tuple) else step for step in self.steps]

    def unprofiled_steps_us(self) -> list:
        """(step index, µs) of each finished unprofiled step."""
        return [(index, self._us(step)) for index, step in enumerate(self.steps) if step is not None]

    @staticmethod
    def _us(step) -> float:
        """A timed step's µs: settled already, or from its CUDA events (else its wall clock)."""
        if isinstance(step, float):
            return step
        t0, e0, t1, e1 = step
        if e0 is not None and e1 is not None:
            e1.synchronize()
            return e0.elapsed_time(e1) * 1e3
        return (t1 - t0) * 1e6

    def summary(self) -> dict:
        """What capture writes into the trace's metadata (docs/capture.md, "unprofiled")."""
        steps = self.unprofiled_steps_us()
        used = [us for index, us in steps if index > 0]
        return {"steps_us": [round(us, 2) for _, us in steps], "step_indices": [i for i, _ in steps],
                "timer": "cuda_events" if self._cuda_timed else "perf_counter",
                "step_us": round(statistics.median(used), 2) if used else None,
                "host_step_us": round(min(self.host_steps_us), 2) if self.host_steps_us else None,
                "host_steps_us": [round(us, 2) for us in self.host_steps_us],
                "note": None if used else "no unprofiled step after the first (warm-up) one was timed"}
