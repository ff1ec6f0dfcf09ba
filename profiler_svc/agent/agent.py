"""``with profiler_svc.capture(model) as cap:`` -- torch.profiler plus module attribution and metadata.

    with profiler_svc.capture(model, wait=1, warmup=1, active=3) as cap:
        for batch in loader:
            train_step(batch)
            cap.step()
    print(cap.trace_path)
    for finding in cap.recommend().findings:
        print(finding.title)

See docs/capture.md for what is recorded and how files are named.
"""
import datetime
import gzip
import inspect
import json
import os
import re
import shutil
import tempfile
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from ..errors import UserError
from ..formats import one_line
from ..trace.labels import METADATA_KEY
from ..workload_spec import check_workload_spec
from .gpu_clocks import GpuClocks
from .hooks import ModuleLabels, class_name
from .metadata import model_device, numerics, rank_and_world_size, static_metadata
from .step_timer import StepTimer, host_alone_steps
from .upload import UploadError, upload_trace

DEFAULT_OUT = "profiler_svc_traces"
URL_ENV = "PROFILER_SVC_URL"
# The wait steps run unprofiled and all but the first (warm-up) are timed to calibrate the analysis: three on
# the host alone (their fastest is the host's step), three in the loop (their median is the step).
DEFAULT_SCHEDULE = {"wait": 7, "warmup": 1, "active": 3}
RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)

if TYPE_CHECKING:
    from ..recommendations.report import Report


class Capture:
    """A torch.profiler session that labels every module call and writes one gzipped trace per cycle.

    out: a folder (default ``profiler_svc_traces``) or a ``.json.gz`` file path.
    wait/warmup/active/repeat: the profiler schedule, counted in ``cap.step()`` calls. Give none
        of them to record the whole block; missing ones default to wait=7, warmup=1, active=3. The wait
        steps after the first run unprofiled and are timed (some on the host alone: step_timer.py), so
        the analysis can take the profiler's own cost out of its figures.
    nvtx: NVTX ranges per module call (domain ``profiler_svc``) when Nsight Systems listens.
    upload: service URL to POST traces to (default ``$PROFILER_SVC_URL``; False: never).
    workload: ``"pkg.module:factory"`` that rebuilds the workload, for the A/B service.
    name: the traces' name (default: the model's class).
    label_modules: ``(qualified_name, module) -> bool``, which submodules get a label (default: all).
        Each labelled call costs host time; where the step waits on the host, labelling fewer
        modules (say, only the decoder layers' direct children) cuts the overhead. The model itself
        is always labelled.
    profile_kwargs: passed on to ``torch.profiler.profile`` (``with_stack``, ``profile_memory``...).
    """

    def __init__(self, model: torch.nn.Module, out: Optional[Union[str, os.PathLike]] = None, *,
                 wait: Optional[int] = None, warmup: Optional[int] = None, active: Optional[int] = None,
                 repeat: int = 1, nvtx: bool = True, record_shapes: bool = True,
                 upload: Optional[Union[str, bool]] = None, workload: Optional[str] = None,
                 name: Optional[str] = None, label_modules: Optional[Callable[[str, torch.nn.Module], bool]] = None,
                 **profile_kwargs: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"capture() needs a torch.nn.Module, got {type(model).__name__}")
        if label_modules is not None and not callable(label_modules):
            raise UserError(f"label_modules must be a function (name, module) -> bool, got {type(label_modules).__name__}")
        self.schedule = _schedule(wait, warmup, active, repeat)
        if workload is not None:
            check_workload_spec(workload)
        self.upload_url: Optional[str] = os.environ.get(URL_ENV) if upload is None else (
            upload if isinstance(upload, str) and upload else None)
        if self.upload_url and not re.match(r"^https?://", self.upload_url):
            raise UserError(f"upload URL must start with http:// or https://, got {self.upload_url!r}")
        for key in ("activities", "schedule", "on_trace_ready"):
            if key in profile_kwargs:
                raise UserError(f"capture() sets {key} itself; it cannot be passed through")
        unknown = sorted(set(profile_kwargs) - set(inspect.signature(torch.profiler.profile).parameters))
        if unknown:
            raise UserError(f"torch.profiler.profile takes no {', '.join(map(repr, unknown))} (capture() passes its "
                            "other keywords on to it)")
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise UserError(f"out must be a path (a folder, or a file ending .json.gz), got {type(out).__name__}")

        self.model = model
        self.name = name or class_name(model)
        self.rank, self.world_size = rank_and_world_size()
        self.run = _run_id()
        self.out_dir, self._file_stem = _output_location(out, self.name, self.run, self.rank, self.world_size)
        self.record_shapes = record_shapes
        self.profile_kwargs = profile_kwargs
        try:
            self.labels = ModuleLabels(model, use_nvtx=nvtx, label_modules=label_modules)
        except Exception as exc:
            if label_modules is None:
                raise
            raise UserError(f"label_modules raised {one_line(exc)}") from None
        self.labels.on_root_call = self._on_model_call
        settings = {**(self.schedule or {}), "record_shapes": record_shapes, "nvtx": nvtx,
                    "labelled_modules": len(self.labels.targets), "label_filter": label_modules is not None,
                    **{k: v for k, v in profile_kwargs.items() if isinstance(v, (bool, int, str))}}
        self.metadata = static_metadata(model, rank=self.rank, world_size=self.world_size,
                                        workload=workload, run=self.run, name=self.name, settings=settings)
        self.trace_paths: list[str] = []
        self.uploads: list[dict] = []  # the service's replies, one per uploaded trace
        self._start_block()
        self.clocks = GpuClocks(model_device(model))  # read as each timed step ends
        self._step_range = None  # this step's ProfilerStep#N range, when capture marks steps itself
        self._numerics = None
        self._profiler: Optional[torch.profiler.profile] = None
        self._cycles_saved = 0

    # ---- the with block --------------------------------------------------------------------

    def __enter__(self) -> "Capture":
        if torch._C._autograd._profiler_enabled():
            # torch's profilers do not nest: the inner one's stop ends the outer session, which then crashes
            raise UserError("a profiler is already recording (torch.profiler, or another capture block): end it "
                            "before this capture starts")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(**self.schedule) if self.schedule else None
        self._profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, record_shapes=self.record_shapes,
            on_trace_ready=self._write_trace, **self.profile_kwargs)
        if self._profiler.current_action in RECORDING:
            _drain_gpu()
        self._profiler.__enter__()
        self._start_block()
        try:
            self.clocks.reset()
            self._sync_labels()
        except Exception as exc:  # no __exit__ follows a failed __enter__: leave nothing running or attached
            profiler, self._profiler = self._profiler, None
            self._discard = True
            self.labels.detach()
            profiler.__exit__(None, None, None)
            raise UserError(f"capture could not label the model's modules: {one_line(exc)}") from None
        self.timer.begin(profiled=self._profiler.current_action != ProfilerAction.NONE)
        return self

    def _start_block(self) -> None:
        """A block's own steps and timings, should the Capture be entered again (its files keep counting)."""
        self.steps = 0
        self.timer = StepTimer(host_steps=host_alone_steps(self.schedule["wait"]) if self.schedule else 0)
        self._discard = False  # the cycle in progress is dropped, not saved (set as the block ends)
        self._recorded = 0  # recorded steps of the cycle that cap.step() closed

    def step(self) -> None:
        """Mark the end of one training or inference step (drives the schedule)."""
        profiler = self._profiler
        if profiler is None:
            raise RuntimeError("cap.step() called outside the capture block")
        self.steps += 1
        if self.timer.end():
            self.clocks.sample()
        self._end_step_mark()
        if profiler.current_action == ProfilerAction.RECORD_AND_SAVE:
            self._add_metadata(profiler)  # the cycle is saved inside this step(): last chance to add it
        if profiler.current_action not in RECORDING and profiler.schedule(profiler.step_num + 1) in RECORDING:
            _drain_gpu()
            self.timer.settle()  # the GPU is idle now: reading the step events costs nothing and stays unrecorded
        # the recorded steps of this cycle that a cap.step() closed (a saved cycle starts the count again)
        self._recorded = 0 if profiler.current_action == ProfilerAction.RECORD_AND_SAVE else (
            self._recorded + (profiler.current_action in RECORDING))
        profiler.step()
        self._sync_labels()
        self.timer.begin(profiled=profiler.current_action != ProfilerAction.NONE)

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        profiler, self._profiler = self._profiler, None
        if profiler is None:  # __exit__ without __enter__, or twice
            return False
        # A cycle cut short by an exception is dropped, not saved half-way through a step; so is one whose only
        # recorded step is the one the last cap.step() opened (the block ended before it ran: an empty step)
        self._discard = exc_type is not None or (self.schedule is not None and not self._recorded)
        self._end_step_mark()
        try:
            if profiler.current_action in RECORDING and not self._discard:
                self._add_metadata(profiler)
            profiler.__exit__(exc_type, exc, tb)
        except Exception as teardown_error:
            if exc_type is None:
                raise
            # The user's exception is the one that matters: ours must not replace it.
            warnings.warn(f"profiler_svc.capture: stopping the profiler failed: {teardown_error}", stacklevel=2)
        finally:
            self.labels.detach()
            self.clocks.close()
        if exc_type is None or issubclass(exc_type, Exception):
            self._upload_all()
        if exc_type is None and not self._cycles_saved:
            warnings.warn(f"profiler_svc.capture: no trace written: the block made {self.steps} "
                          f"cap.step() calls, the schedule {self.schedule} needs more", stacklevel=2)
        return False  # never swallow the user's exception

    # ---- results ---------------------------------------------------------------------------

    @property
    def trace_path(self) -> Optional[str]:
        """The last trace written (one per schedule cycle), or None."""
        return self.trace_paths[-1] if self.trace_paths else None

    def recommend(self, **kwargs: Any) -> "Report":
        """Analyse the last trace written: ``profiler_svc.recommend(cap.trace_path, **kwargs)``."""
        if self.trace_path is None:
            raise UserError("capture wrote no trace to analyse")
        from .. import recommend  # lazily: the analyser's dependencies load only when asked for
        return recommend(self.trace_path, **kwargs)

    # ---- internals -------------------------------------------------------------------------

    def _sync_labels(self):
        """Labels only while the profiler warms up or records: nothing to pay for elsewhere."""
        if self._profiler.current_action == ProfilerAction.NONE:
            self.labels.detach()
        else:
            self.labels.attach()

    def _on_model_call(self):
        if self._profiler is not None and self._profiler.current_action in RECORDING:
            self._sample_numerics()  # in the recorded window: its autocast, not the warm-up's
        # Without a schedule torch.profiler marks no steps: the step's first model call opens its
        # ProfilerStep#N range, cap.step() closes it (so no empty step follows the last one).
        if self.schedule is None and self._step_range is None:
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{self.steps}")
            self._step_range.__enter__()

    def _end_step_mark(self):
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _sample_numerics(self):
        # Called as the model is entered, so that autocast and sdpa_kernel contexts around the
        # call are seen. Once per saved cycle.
        if self._numerics is None:
            self._numerics = numerics()

    def _add_metadata(self, profiler):
        metadata = {**self.metadata, "numerics": self._numerics or numerics(), "steps": self.steps,
                    "unprofiled": {**self.timer.summary(), "gpu_clocks": self.clocks.summary()}}
        profiler.add_metadata_json(METADATA_KEY, json.dumps(metadata))

    def _write_trace(self, profiler):
        """on_trace_ready: export, gzip and rename into place, so no reader sees a partial file."""
        self._numerics = None
        if self._discard:
            return
        self._cycles_saved += 1
        cycle = len(self.trace_paths)
        stem = self._file_stem + (f"_cycle{cycle}" if cycle else "")
        path = os.path.join(self.out_dir, stem + ".json.gz")
        raw = packed = None
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            fd, raw = tempfile.mkstemp(dir=self.out_dir, prefix=f".{stem}.", suffix=".json.partial")
            os.close(fd)
            profiler.export_chrome_trace(raw)
            fd, packed = tempfile.mkstemp(dir=self.out_dir, prefix=f".{stem}.", suffix=".gz.partial")
            with os.fdopen(fd, "wb") as sink, open(raw, "rb") as source, \
                    gzip.GzipFile(filename="", mode="wb", fileobj=sink, compresslevel=6) as zipped:
                shutil.copyfileobj(source, zipped, 1 << 20)
            os.chmod(packed, 0o644)
            os.replace(packed, path)
            packed = None
            self.trace_paths.append(path)
        except Exception as exc:  # a diagnostic tool must not kill the training job
            warnings.warn(f"profiler_svc.capture: could not write {path}: {exc}", stacklevel=2)
        finally:
            for leftover in (raw, packed):
                if leftover and os.path.exists(leftover):
                    os.remove(leftover)

    def _upload_all(self):
        if not self.upload_url:
            return
        for path in self.trace_paths:
            stem = os.path.basename(path).removesuffix(".json.gz")
            try:
                self.uploads.append(upload_trace(self.upload_url, path, name=stem, run=self.run,
                                                 host=self.metadata["host"],
                                                 workload=self.metadata["workload"]))
            except (UploadError, OSError) as exc:
                warnings.warn(f"profiler_svc.capture: upload failed, trace kept at {path}: {exc}",
                              stacklevel=3)


# `with profiler_svc.capture(model) as cap:` reads as a function call; the class is the one signature.
capture = Capture


def _schedule(wait, warmup, active, repeat):
    given = {"wait": wait, "warmup": warmup, "active": active}
    if all(v is None for v in given.values()):
        return None
    schedule = {k: DEFAULT_SCHEDULE[k] if v is None else v for k, v in given.items()}
    schedule["repeat"] = repeat
    for key, value in schedule.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{key} must be a non-negative integer, got {value!r}")
    if schedule["active"] < 1:
        raise UserError("active must be at least 1")
    return schedule


def _run_id():
    """One id for all ranks of a job where the launcher gives one, so the service can group them."""
    for env in ("PROFILER_SVC_RUN", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(env)
        if value and value != "none":
            return _safe(value)
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _safe(text):
    """A string usable in a file name."""
    return re.sub(r"[^\w.-]", "_", text)


def _output_location(out, name, run, rank, world_size):
    """(folder, file stem). A folder gets ``<name>_<run>_rank<r>``; a file path keeps its name,
    with ``_rank<r>`` added when there are several ranks."""
    out = os.fspath(out) if out is not None else os.environ.get("PROFILER_SVC_OUT", DEFAULT_OUT)
    if out.endswith(".json.gz"):
        folder, stem = os.path.split(out)
        stem = stem.removesuffix(".json.gz") + (f"_rank{rank}" if world_size > 1 else "")
    else:
        folder, stem = out, f"{_safe(name)}_{run}_rank{rank}"
    folder = folder or "."
    # checked now, made when the first trace is written: a capture that writes none leaves no empty folder
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"cannot create trace folder {folder}: {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise UserError(f"trace folder {folder} is not writable")
    return folder, stem


def _drain_gpu():
    """Wait for the GPU before recording starts: kernels queued by the steps before, which the trace does
    not hold, would otherwise run inside the first recorded step and lengthen it. Once per cycle."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
