"""The capture agent on CPU: hooks removed, labels and metadata in the trace, schedule, ranks, upload."""
import glob
import gzip
import http.server
import json
import os
import sys
import threading
from email.parser import BytesParser

import pytest
import torch
import torch.nn as nn

import profiler_svc
from profiler_svc.agent import hooks as capture_hooks
from profiler_svc.errors import UserError
from profiler_svc.trace.labels import METADATA_KEY, METADATA_SCHEMA, module_label, parse_module_label


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)  # in place on fc's output: must survive the backward hooks

    def forward(self, x, *, scale=1.0):
        return x + self.act(self.fc(self.norm(x))) * scale


class TinyModel(nn.Module):
    def __init__(self, width=16, classes=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, classes, bias=False).to(torch.float64)

    def forward(self, x):
        for block in self.blocks:
            x = block(x=x, scale=0.5)  # keyword inputs, as Hugging Face layers take them
        return self.head(x.double())


MODULES = {"": "TinyModel", "blocks": "ModuleList", "blocks.0": "Block", "blocks.0.norm": "LayerNorm",
           "blocks.0.fc": "Linear", "blocks.0.act": "ReLU", "blocks.1": "Block", "blocks.1.norm": "LayerNorm",
           "blocks.1.fc": "Linear", "blocks.1.act": "ReLU", "head": "Linear"}
CALLED = {name: cls for name, cls in MODULES.items() if name != "blocks"}  # ModuleList is never called


def train_step(model, x):
    model(x).sum().backward()


def load(path):
    with gzip.open(path) as f:
        return json.load(f)


def module_labels(trace):
    return [e["name"] for e in trace["traceEvents"] if parse_module_label(e.get("name", ""))]


def hook_state(model):
    """Every hook dict and instance attribute of every module, by content, plus the parameters by
    identity and value."""
    modules = {name: {key: dict(value) if "hook" in key and isinstance(value, dict) else value
                      for key, value in vars(module).items()
                      if key not in ("_parameters", "_buffers", "_modules")}
               for name, module in model.named_modules()}
    params = {name: (id(p), p.detach().clone()) for name, p in model.named_parameters()}
    return modules, params, model.training


def assert_same_state(before, after):
    assert after[0] == before[0]
    assert after[2] == before[2]
    assert after[1].keys() == before[1].keys()
    for name, (identity, value) in before[1].items():
        assert after[1][name][0] == identity
        assert torch.equal(after[1][name][1], value)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyModel()


@pytest.fixture
def x():
    return torch.randn(3, 16)


def test_labels_and_metadata_in_trace(model, x, tmp_path):
    with profiler_svc.capture(model, out=tmp_path, workload="tests.capture:build") as cap:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # sampled as the model is entered
            train_step(model, x)
    assert os.path.dirname(cap.trace_path) == str(tmp_path)
    assert cap.trace_path.endswith("_rank0.json.gz")
    trace = load(cap.trace_path)

    labels = module_labels(trace)
    assert sorted(set(labels)) == sorted(module_label(n, c) for n, c in CALLED.items())
    assert len(labels) == len(CALLED)  # one call each; no schedule: the whole block is recorded
    # Written as cheap cpu_op ranges; the analyser reads them as labels, not as ops.
    assert {e["cat"] for e in trace["traceEvents"] if e.get("name") in labels} == {"cpu_op"}
    cpu = profiler_svc.load_trace(cap.trace_path).cpu
    assert set(cpu.loc[cpu["name"].isin(labels), "cat"]) == {"user_annotation"}
    addmm = cpu[cpu["name"] == "aten::addmm"]
    assert "blocks.0.fc (Linear)" in set(addmm["module"])
    # Ops run inside their module's label: the Linear's addmm lies within blocks.0.fc's span.
    fc = next(e for e in trace["traceEvents"] if e.get("name") == module_label("blocks.0.fc", "Linear"))
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::addmm" and e["tid"] == fc["tid"]
               and fc["ts"] <= e["ts"] <= fc["ts"] + fc["dur"] for e in trace["traceEvents"])

    meta = trace[METADATA_KEY]
    assert meta["schema"] == METADATA_SCHEMA
    assert {n: m["class"] for n, m in meta["modules"].items()} == MODULES
    assert meta["modules"]["head"]["params"] == {"weight": {"dtype": "float64", "shape": [4, 16]}}
    assert meta["modules"]["blocks.1.fc"]["params"]["bias"] == {"dtype": "float32", "shape": [16]}
    numerics = meta["numerics"]
    assert numerics["autocast"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    assert numerics["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert numerics["allow_tf32_matmul"] == torch.backends.cuda.matmul.allow_tf32
    assert set(numerics["sdpa_backends"]) == {"flash", "mem_efficient", "math", "cudnn"}
    assert meta["device"]["type"] == "cpu"
    assert meta["versions"]["torch"] == torch.__version__
    assert (meta["rank"], meta["world_size"], meta["workload"]) == (0, 1, "tests.capture:build")


def test_recommend_analyses_the_trace(model, x, tmp_path):
    with profiler_svc.capture(model, out=tmp_path) as cap:
        train_step(model, x)
    report = cap.recommend().to_dict()
    assert report["source"]["files"] == [cap.trace_path]
    assert report["trace"]["labelled"] is True


def test_tf32_read_through_the_new_precision_api():
    from profiler_svc.agent.metadata import numerics
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    try:
        matmul.fp32_precision = "ieee"  # after this torch refuses to read matmul.allow_tf32
        settings = numerics()
        assert settings["allow_tf32_matmul"] is False
        assert settings["fp32_precision"]["matmul"] == "ieee"
        assert settings["float32_matmul_precision"] == "highest"
        matmul.fp32_precision = "tf32"
        assert numerics()["allow_tf32_matmul"] is True
        assert numerics()["float32_matmul_precision"] == "high"
    finally:
        matmul.fp32_precision = "none"


def test_labels_removed_and_model_unchanged(model, x, tmp_path):
    before = hook_state(model)
    reference = TinyModel()
    reference.load_state_dict(model.state_dict())
    train_step(reference, x)
    with profiler_svc.capture(model, out=tmp_path) as cap:
        assert cap.labels.attached
        train_step(model, x)
    assert_same_state(before, hook_state(model))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name  # the hooks change no gradient


def test_user_exception_propagates_untouched(model, x, tmp_path):
    before = hook_state(model)
    error = ValueError("from the user's step")
    with pytest.raises(ValueError) as raised:
        with profiler_svc.capture(model, out=tmp_path, wait=0, warmup=0, active=2) as cap:
            train_step(model, x)
            cap.step()
            raise error
    assert raised.value is error
    assert_same_state(before, hook_state(model))
    assert cap.trace_paths == [] and os.listdir(tmp_path) == []  # the interrupted cycle is dropped


def test_exception_inside_forward_closes_labels(model, x, tmp_path):
    before = hook_state(model)

    def fail(_module, _args, _output):
        raise RuntimeError("inside blocks.1.fc")

    handle = model.blocks[1].fc.register_forward_hook(fail)
    with profiler_svc.capture(model, out=tmp_path) as cap:
        with pytest.raises(RuntimeError, match="inside blocks.1.fc"):
            model(x)
        handle.remove()
        model(x)  # the next call is labelled from the root again
        assert not getattr(cap.labels.local, "stack", None)  # nothing left open
    assert_same_state(before, hook_state(model))
    labels = module_labels(load(cap.trace_path))
    assert labels.count(module_label("", "TinyModel")) == 2


def test_schedule_wait_warmup_active(model, x, tmp_path):
    attached = []
    with profiler_svc.capture(model, out=tmp_path, wait=1, warmup=1, active=2, repeat=2) as cap:
        for _ in range(9):
            attached.append(cap.labels.attached)
            train_step(model, x)
            cap.step()
    # Hooks only in warmup and active steps; two cycles of wait, warmup, active, active.
    assert attached == [False, True, True, True, False, True, True, True, False]
    assert len(cap.trace_paths) == 2
    assert cap.trace_paths[0].endswith("_rank0.json.gz")
    assert cap.trace_paths[1] == cap.trace_paths[0].replace("_rank0", "_rank0_cycle1")
    for path, steps in zip(cap.trace_paths, ([2, 3], [6, 7])):
        trace = load(path)
        recorded = sorted(int(e["name"].split("#")[1]) for e in trace["traceEvents"]
                          if e.get("name", "").startswith("ProfilerStep#"))
        assert recorded == steps
        assert module_labels(trace).count(module_label("", "TinyModel")) == 2
        assert trace[METADATA_KEY]["capture"]["active"] == 2


def test_too_few_steps_warns(model, x, tmp_path):
    with pytest.warns(UserWarning, match="no trace written"):
        with profiler_svc.capture(model, out=tmp_path, wait=2, warmup=1, active=1) as cap:
            train_step(model, x)
            cap.step()
    assert cap.trace_path is None and os.listdir(tmp_path) == []


def test_a_block_that_ends_as_recording_begins_writes_no_empty_trace(model, x, tmp_path):
    """wait 7, warmup 1, active 3 and 8 steps: the 8th cap.step() opened the first recorded step and the block
    ended; the trace held that one empty ProfilerStep#8, with no warning, and recommend found 1 step and nothing."""
    with pytest.warns(UserWarning, match="no trace written"):
        with profiler_svc.capture(model, out=tmp_path / "traces", active=3) as cap:
            for _ in range(8):
                train_step(model, x)
                cap.step()
    assert cap.trace_path is None and not (tmp_path / "traces").exists()  # nor an empty folder


def test_a_capture_inside_a_running_profiler_is_refused(model, x, tmp_path):
    """torch's profilers do not nest: the inner one's stop ended the outer session, whose export then crashed
    the process (a segfault)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
        with pytest.raises(UserError, match="a profiler is already recording"):
            with profiler_svc.capture(model, out=tmp_path):
                model(x)
        model(x)
    assert any(e.name == "aten::linear" for e in outer.events()) and os.listdir(tmp_path) == []


def test_a_module_that_cannot_be_labelled_leaves_nothing_running(model, x, tmp_path):
    """A TorchScript submodule refuses forward hooks: __enter__ raised torch's RuntimeError and left the profiler
    recording and the other modules' labels in place, as no __exit__ follows a failed __enter__."""
    model.head = torch.jit.script(nn.Linear(16, 4))
    before = hook_state(model)
    with pytest.raises(UserError, match="capture could not label the model's modules: .*ScriptModule"):
        with profiler_svc.capture(model, out=tmp_path):
            model(x)
    assert not torch._C._autograd._profiler_enabled()
    assert_same_state(before, hook_state(model)) and os.listdir(tmp_path) == []


def test_numerics_are_read_in_the_recorded_window(model, x, tmp_path):
    """Sampled at the first labelled call, in warm-up: a step recorded under bf16 autocast read as without it."""
    with profiler_svc.capture(model, out=tmp_path, wait=1, warmup=1, active=1) as cap:
        for i in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 2):
                model(x)
            cap.step()
    assert load(cap.trace_path)[METADATA_KEY]["numerics"]["autocast"]["cpu"]["enabled"] is True


def test_a_folder_of_one_captures_cycles_is_said_to_be_so(model, x, tmp_path, capsys):
    """repeat=2 writes a file a cycle, both rank 0: recommend refused the folder as "a folder holds one job's
    traces, one file a rank", which did not say why there were two."""
    from profiler_svc.cli import main
    with profiler_svc.capture(model, out=tmp_path / "cycles", wait=0, warmup=1, active=1, repeat=2) as cap:
        for _ in range(4):
            model(x)
            cap.step()
    assert len(cap.trace_paths) == 2
    assert main(["recommend", str(tmp_path / "cycles")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "are both rank 0, two cycles of one capture" in err


def test_a_capture_entered_again_counts_its_own_steps(model, x, tmp_path):
    """Reused for a second block, a Capture kept the first block's step count and timed steps: its trace's metadata
    said 6 steps for a block of 3, its step indices mixed both blocks'."""
    cap = profiler_svc.capture(model, out=tmp_path, wait=1, warmup=1, active=1)
    for _ in range(2):
        with cap:
            for _ in range(3):
                model(x)
                cap.step()
    first, second = (load(p)[METADATA_KEY] for p in cap.trace_paths)
    assert first["steps"] == second["steps"] == 3
    assert first["unprofiled"]["step_indices"] == second["unprofiled"]["step_indices"] == [0]


def test_a_copy_made_inside_the_block_is_unlabelled_after_it(model, x, tmp_path):
    """An EMA copy (deepcopy inside the block) kept the labelled forward: called after the block it opened a
    ProfilerStep range on the finished capture, and a later profiler session recorded its labels."""
    import copy
    with profiler_svc.capture(model, out=tmp_path) as cap:
        model(x)
        ema = copy.deepcopy(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as later:
        out = ema(x)
    names = {e.name for e in later.events()}
    assert cap._step_range is None and not any(n.startswith(("module::", "ProfilerStep")) for n in names)
    assert torch.equal(out, model(x))


@pytest.mark.parametrize("rank, world", [("abc", "2"), ("0", "x"), ("3", "2")])
def test_a_rank_the_environment_cannot_mean_is_one_line(model, tmp_path, monkeypatch, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(UserError, match="are not a rank of a world"):
        profiler_svc.capture(model, out=tmp_path)


def test_ranks_write_their_own_files(model, x, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    with profiler_svc.capture(model, out=tmp_path) as cap:
        model(x)
    assert os.path.basename(cap.trace_path) == "TinyModel_job42_rank1.json.gz"
    meta = load(cap.trace_path)[METADATA_KEY]
    assert (meta["rank"], meta["world_size"], meta["run"]) == (1, 2, "job42")
    with profiler_svc.capture(model, out=tmp_path / "named.json.gz") as cap:
        model(x)
    assert cap.trace_path == str(tmp_path / "named_rank1.json.gz")


def test_write_failure_warns_and_leaves_nothing(model, x, tmp_path, monkeypatch):
    def broken_export(self, path):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
        raise OSError("disk full")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", broken_export)
    with pytest.warns(UserWarning, match="could not write .*disk full"):
        with profiler_svc.capture(model, out=tmp_path) as cap:
            model(x)
    assert cap.trace_paths == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"wait": -1}, "wait must be a non-negative integer"),
    ({"active": 0}, "active must be at least 1"),
    ({"workload": "not a reference"}, "workload must look like"),
    ({"upload": "ftp://host"}, "must start with http"),
    ({"schedule": None}, "sets schedule itself"),
    ({"with_stak": True}, "torch.profiler.profile takes no 'with_stak'"),  # raised at __enter__, a folder made
])
def test_bad_arguments(model, tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        profiler_svc.capture(model, out=tmp_path, **kwargs)
    assert os.listdir(tmp_path) == []


def test_bad_model_and_folder(model, tmp_path):
    with pytest.raises(UserError, match="needs a torch.nn.Module"):
        profiler_svc.capture(lambda x: x)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot create trace folder"):
        profiler_svc.capture(model, out=blocker / "traces")
    with pytest.raises(UserError, match="out must be a path"):
        profiler_svc.capture(model, out=123)


# ---- upload -------------------------------------------------------------------------------

class IngestHandler(http.server.BaseHTTPRequestHandler):
    received = []
    status = 201

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        message = BytesParser().parsebytes(
            f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + body)
        form = {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                for part in message.get_payload()}
        type(self).received.append((self.path, self.headers.get("Authorization"), form))
        reply = json.dumps({"id": len(self.received)}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def ingest_server():
    handler = type("Handler", (IngestHandler,), {"received": []})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_upload_posts_trace_with_token(model, x, tmp_path, ingest_server, monkeypatch):
    handler, url = ingest_server
    monkeypatch.setenv("PROFILER_SVC_TOKEN", "s3cret")
    monkeypatch.setenv("PROFILER_SVC_URL", url)
    with profiler_svc.capture(model, out=tmp_path, workload="my_pkg.jobs:tiny") as cap:
        model(x)
    assert cap.uploads == [{"id": 1}]
    [(path, auth, form)] = handler.received
    assert (path, auth) == ("/api/v1/traces", "Bearer s3cret")
    with open(cap.trace_path, "rb") as f:
        assert form["file"] == f.read()
    assert form["run"].decode() == cap.run
    assert form["workload"] == b"my_pkg.jobs:tiny" and form["host"]
    assert form["name"].decode() == os.path.basename(cap.trace_path).removesuffix(".json.gz")


def test_upload_failure_warns_and_keeps_trace(model, x, tmp_path, ingest_server):
    handler, url = ingest_server
    handler.status = 500
    with pytest.warns(UserWarning, match="upload failed, trace kept at .*HTTP 500"):
        with profiler_svc.capture(model, out=tmp_path, upload=url) as cap:
            model(x)
    assert os.path.exists(cap.trace_path) and cap.uploads == []
    with pytest.warns(UserWarning, match="upload failed.*could not reach"):
        with profiler_svc.capture(model, out=tmp_path, upload="http://127.0.0.1:9") as cap:
            model(x)
    assert os.path.exists(cap.trace_path)


# ---- NVTX ranges (a stand-in domain: no Nsight Systems on CI) -----------------------------

class RecordingDomain:
    def __init__(self):
        self.events = []
        self.open = {}

    def get_event_attributes(self, message):
        return message

    def push_range(self, message):
        self.events.append(("push", message))

    def pop_range(self):
        self.events.append(("pop", None))

    def start_range(self, message):
        range_id = len(self.events)
        self.open[range_id] = message
        self.events.append(("start", message))
        return range_id

    def end_range(self, range_id):
        self.events.append(("end", self.open.pop(range_id)))


def test_nvtx_ranges_forward_and_backward(model, x, tmp_path, monkeypatch):
    domain = RecordingDomain()
    monkeypatch.setattr(capture_hooks, "nvtx_domain", lambda: domain)
    before = hook_state(model)
    with profiler_svc.capture(model, out=tmp_path):
        train_step(model, x)
    assert_same_state(before, hook_state(model))

    depth, pushed = 0, []
    for kind, message in domain.events:
        if kind == "push":
            depth += 1
            pushed.append(message)
        elif kind == "pop":
            depth -= 1
            assert depth >= 0
    assert depth == 0 and pushed == [module_label(n, c) for n, c in CALLED.items()]

    started = [m for kind, m in domain.events if kind == "start"]
    assert domain.open == {}  # every backward range ended
    # Every module whose input needs a gradient gets one, in backward order: the head first.
    # x needs none, so the modules that take it do not: no end could be seen for them.
    assert started[0] == "backward::head (Linear)"
    takes_x = {"", "blocks.0", "blocks.0.norm"}
    assert sorted(started) == sorted(f"backward::{n} ({c})" for n, c in CALLED.items() if n not in takes_x)


def test_nvtx_off_means_no_ranges(model, x, tmp_path, monkeypatch):
    domain = RecordingDomain()
    monkeypatch.setattr(capture_hooks, "nvtx_domain", lambda: domain)
    with profiler_svc.capture(model, out=tmp_path, nvtx=False) as cap:
        train_step(model, x)
    assert domain.events == [] and module_labels(load(cap.trace_path))


def test_compiled_model_labels_its_root_only(model, x, tmp_path):
    compiled = torch.compile(model, backend="eager")
    compiled(x)
    with profiler_svc.capture(compiled, out=tmp_path) as cap:
        compiled(x)
    trace = load(cap.trace_path)
    assert module_labels(trace) == [module_label("", "TinyModel")]
    assert {n: m["class"] for n, m in trace[METADATA_KEY]["modules"].items()} == MODULES
    assert not any(h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))


def test_parallel_wrapper_adds_no_name_step(model, x, tmp_path):
    if torch.cuda.is_available():  # DataParallel wants the module on cuda:0 where there is a GPU
        model, x = model.cuda(), x.cuda()
    wrapped = nn.DataParallel(model)  # names as DDP gives them: the wrapper's `module.` is dropped
    with profiler_svc.capture(wrapped, out=tmp_path) as cap:
        wrapped(x)
    trace = load(cap.trace_path)
    assert sorted(module_labels(trace)) == sorted(module_label(n, c) for n, c in CALLED.items())
    assert {n: m["class"] for n, m in trace[METADATA_KEY]["modules"].items()} == MODULES
    assert os.path.basename(cap.trace_path).startswith("TinyModel_")


def gpu_capture(tmp_path, width, rows, steps, sync, **schedule):
    """Train a TinyModel on the GPU for `steps` steps under capture; the capture."""
    torch.manual_seed(0)
    model = TinyModel(width=width).cuda()
    x = torch.randn(rows, width, device="cuda")
    with profiler_svc.capture(model, out=tmp_path, **schedule) as cap:
        for _ in range(steps):
            train_step(model, x)
            if sync:
                torch.cuda.synchronize()
            cap.step()
    return cap


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_run_inside_module_labels(tmp_path):
    cap = gpu_capture(tmp_path, 256, 64, 2, True, wait=0, warmup=1, active=1)
    trace = load(cap.trace_path)
    kernels = profiler_svc.load_trace(cap.trace_path).kernels
    assert "blocks.0.fc (Linear)" in set(kernels["module"])  # the GEMM's kernel links to its module
    meta = trace[METADATA_KEY]
    assert meta["device"]["type"] == "cuda" and meta["device"]["sm_count"] > 0
    assert meta["versions"]["cuda"] == torch.version.cuda


def test_teardown_failure_does_not_replace_user_exception(model, x, tmp_path, monkeypatch):
    def broken_exit(self, *exc_info):
        raise RuntimeError("kineto fell over")

    monkeypatch.setattr(torch.profiler.profile, "__exit__", broken_exit)
    before = hook_state(model)
    with pytest.warns(UserWarning, match="kineto fell over"), pytest.raises(KeyError, match="user"):
        with profiler_svc.capture(model, out=tmp_path):
            model(x)
            raise KeyError("user")
    assert_same_state(before, hook_state(model))
    monkeypatch.undo()
    torch.autograd.profiler._disable_profiler()  # the real profiler our stand-in never stopped


def test_torchrun_ranks_share_a_run(tmp_path):
    import subprocess
    import sys
    job = os.path.join(os.path.dirname(__file__), "torchrun_job.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           job, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # torchrun's and the ranks' own errors
    paths = sorted(glob.glob(str(tmp_path / "*.json.gz")))
    assert [p.rsplit("_", 1)[1] for p in paths] == ["rank0.json.gz", "rank1.json.gz"]
    metas = [load(p)[METADATA_KEY] for p in paths]
    assert [(m["rank"], m["world_size"]) for m in metas] == [(0, 2), (1, 2)]
    assert metas[0]["run"] == metas[1]["run"] and os.path.basename(paths[0]).startswith("Sequential_")
    assert module_label("1", "ReLU") in module_labels(load(paths[1]))  # DDP's `module.` is not in the names


def test_label_modules_picks_the_labelled_submodules(model, x, tmp_path):
    only_linear = lambda name, module: isinstance(module, nn.Linear)  # noqa: E731
    with profiler_svc.capture(model, out=tmp_path, label_modules=only_linear) as cap:
        train_step(model, x)
    labels = set(module_labels(load(cap.trace_path)))
    assert labels == {module_label("", "TinyModel")} | {module_label(n, "Linear") for n in ("blocks.0.fc", "blocks.1.fc", "head")}
    cpu = profiler_svc.load_trace(cap.trace_path).cpu
    assert "blocks.0.fc (Linear)" in set(cpu.loc[cpu["name"] == "aten::addmm", "module"])
    settings = load(cap.trace_path)[METADATA_KEY]["capture"]
    assert settings["label_filter"] is True and settings["labelled_modules"] == 4
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_label_modules_errors_are_one_line(model, tmp_path):
    with pytest.raises(UserError, match="label_modules must be a function"):
        profiler_svc.capture(model, out=tmp_path, label_modules="Linear")
    with pytest.raises(UserError, match="label_modules raised KeyError"):
        profiler_svc.capture(model, out=tmp_path, label_modules=lambda name, module: {}[name])


def test_labelled_forward_is_transparent(model, x, tmp_path):
    """While labelled, a module's forward keeps its signature, and a deep copy made inside the block
    (an EMA model, say) computes with its own parameters and leaves nothing of the capture behind."""
    import copy
    import inspect
    signature = inspect.signature(model.blocks[0].forward)
    with profiler_svc.capture(model, out=tmp_path) as cap:
        assert "forward" in vars(model.blocks[0])  # the labelled forward is in place
        assert inspect.signature(model.blocks[0].forward) == signature
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2.0)
        twin_out = twin(x)
    plain_twin = copy.deepcopy(model)
    plain_twin.load_state_dict(twin.state_dict())
    assert torch.equal(twin_out, plain_twin(x))  # the copy ran its own (doubled) parameters
    assert not torch.equal(twin_out, model(x))
    # The copy's calls were labelled too (its forward is bound to the copy, same label).
    assert module_labels(load(cap.trace_path)).count(module_label("", "TinyModel")) == 1
    assert not any("forward" in vars(m) for m in model.modules())


def test_forward_set_by_the_user_is_kept(model, x, tmp_path):
    """A module whose forward is already an instance attribute is labelled by hooks and keeps it;
    a forward the user sets inside the block survives the exit."""
    calls = []
    original = model.blocks[0].fc.forward

    def counted(inp):
        calls.append(1)
        return original(inp)

    model.blocks[0].fc.forward = counted
    before = hook_state(model)
    with profiler_svc.capture(model, out=tmp_path) as cap:
        model(x)
        replacement = nn.LayerNorm.forward.__get__(model.blocks[1].norm)  # a plain bound forward
        model.blocks[1].norm.forward = replacement  # set by the user mid-block, over the labelled one
    assert calls == [1]
    assert vars(model.blocks[0].fc)["forward"] is counted
    assert vars(model.blocks[1].norm)["forward"] is replacement
    del vars(model.blocks[1].norm)["forward"]
    assert_same_state(before, hook_state(model))
    assert sorted(module_labels(load(cap.trace_path))) == sorted(module_label(n, c) for n, c in CALLED.items())


def test_hugging_face_generate_and_training_under_capture(tmp_path):
    """A transformers Llama trains and generates inside the block exactly as outside it: generate
    inspects forward's signature, and the layers take keyword inputs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 5))
    expected = llama.generate(ids, max_new_tokens=4, do_sample=False)
    loss = llama(ids, labels=ids).loss
    before = hook_state(llama)
    with profiler_svc.capture(llama, out=tmp_path) as cap:
        generated = llama.generate(ids, max_new_tokens=4, do_sample=False)
        labelled_loss = llama(ids, labels=ids).loss
    assert torch.equal(generated, expected)
    assert torch.equal(labelled_loss, loss)
    assert_same_state(before, hook_state(llama))
    labels = module_labels(load(cap.trace_path))
    assert labels.count(module_label("model.layers.1.mlp.act_fn", "SiLUActivation")) == 5  # 4 generate steps + 1


def test_static_forward_is_labelled_by_hooks(tmp_path):
    class Doubler(nn.Module):
        @staticmethod
        def forward(x):
            return 2 * x

    model = nn.Sequential(nn.Linear(4, 4), Doubler())
    x = torch.randn(2, 4)
    expected = model(x)
    with profiler_svc.capture(model, out=tmp_path) as cap:
        assert "forward" not in vars(model[1]) and model[1]._forward_pre_hooks
        out = model(x)
    assert torch.equal(out, expected)
    assert module_label("1", "Doubler") in module_labels(load(cap.trace_path))


def test_without_cuda_every_wait_step_after_the_first_is_timed(model, x, tmp_path):
    """No GPU to wait on: the host-alone step is not taken, the wait steps after the warm-up are all timed."""
    if torch.cuda.is_available():
        pytest.skip("the CPU-only behaviour")
    with profiler_svc.capture(model, out=tmp_path, wait=4, warmup=1, active=1) as cap:
        for _ in range(6):
            train_step(model, x)
            cap.step()
    unprofiled = load(cap.trace_path)[METADATA_KEY]["unprofiled"]
    assert unprofiled["step_indices"] == [0, 1, 2, 3] and unprofiled["host_step_us"] is None
    assert unprofiled["gpu_clocks"] is None  # no GPU clock to read


def test_step_events_are_read_before_recording_starts(model, x, tmp_path, monkeypatch):
    """Capture writes its metadata inside the last recorded step. The timed steps' CUDA events are read
    before recording starts: read there, their synchronize calls would be in the user's trace as host syncs
    (they were: four cudaEventSynchronize in every capture's last step). Events stand in for CUDA's here."""
    from profiler_svc.agent.agent import Capture
    from profiler_svc.agent.step_timer import StepTimer

    reads = []

    class Event:
        def __init__(self):
            self.at = len(reads)

        def synchronize(self):
            reads.append(recording[0])

        def elapsed_time(self, end):
            return 1.0 + end.at  # ms

    recording = [False]
    add_metadata = Capture._add_metadata

    def add_metadata_while_recording(self, profiler):
        recording[0] = True
        add_metadata(self, profiler)

    monkeypatch.setattr(StepTimer, "_event", staticmethod(Event))
    monkeypatch.setattr(Capture, "_add_metadata", add_metadata_while_recording)
    with profiler_svc.capture(model, out=tmp_path, wait=2, warmup=1, active=2) as cap:
        for _ in range(5):
            train_step(model, x)
            cap.step()
    unprofiled = load(cap.trace_path)[METADATA_KEY]["unprofiled"]
    assert reads and not any(reads) and unprofiled["timer"] == "cuda_events"
    assert unprofiled["steps_us"] and all(us >= 1000.0 for us in unprofiled["steps_us"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wait_steps_time_the_host_alone(tmp_path):
    """With 5 wait steps the second and third start on an idle GPU and are timed on the host's clock: a step
    whose GPU work outlasts its launches takes the host less time than the GPU's step."""
    cap = gpu_capture(tmp_path, 2048, 8192, 7, False, wait=5, warmup=1, active=1)
    unprofiled = load(cap.trace_path)[METADATA_KEY]["unprofiled"]
    assert unprofiled["step_indices"] == [0, 3, 4]  # steps 1 and 2 were timed on the host alone
    assert len(unprofiled["host_steps_us"]) == 2 and unprofiled["host_step_us"] == min(unprofiled["host_steps_us"])
    assert 0 < unprofiled["host_step_us"] < unprofiled["step_us"]
    clocks = unprofiled["gpu_clocks"]  # read through NVML as each loop-timed step but the warm-up one ended
    assert clocks["samples"] == 2 and 0 < clocks["sm_mhz"] <= clocks["max_sm_mhz"] and clocks["power_limit_w"] > 0
    assert 0 <= clocks["power_capped"] <= 2


def test_gpu_clocks_read_nvml_and_pair_its_init_and_shutdown(monkeypatch):
    """GpuClocks against a stand-in pynvml of a driver before R535 (the reasons under their old name only): the
    device is found by its CUDA UUID, each reading is kept, the summary counts the power-cap and thermal bits,
    and every nvmlInit is matched by one nvmlShutdown, also where the lookup fails (then nothing is read)."""
    import types

    from profiler_svc.agent import gpu_clocks

    calls = {"init": 0, "shutdown": 0, "uuid": []}
    readings = iter([(1905, 0x4), (1860, 0x4 | 0x20), (1980, 0x1)])
    current: list = []

    def handle_by_uuid(uuid):
        calls["uuid"].append(uuid)
        if uuid != "GPU-a5af9349":
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle"

    def clock(handle, which):
        current[:] = next(readings)
        return current[0]

    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByUUID=handle_by_uuid, nvmlDeviceGetMaxClockInfo=lambda handle, which: 1980,
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: 700_000, nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: current[1] if current else 0)
    uuid = ["a5af9349"]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_clocks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_clocks.torch.version, "cuda", "13.0")
    monkeypatch.setattr(gpu_clocks.torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid=uuid[0]))

    clocks = gpu_clocks.GpuClocks(torch.device("cuda", 0))
    for _ in range(3):
        clocks.sample()
    clocks.close()
    clocks.close()
    assert calls["uuid"] == ["GPU-a5af9349"] and calls["init"] == calls["shutdown"] == 1
    assert clocks.summary() == {"samples": 3, "sm_mhz": 1905.0, "max_sm_mhz": 1980.0, "power_limit_w": 700.0,
                                "power_capped": 2, "thermal_slowdown": 1}
    uuid[0] = "unknown"  # a device NVML does not know (a MIG slice): no readings, NVML closed again
    clocks.reset()
    clocks.sample()
    assert clocks.summary() is None and calls["init"] == calls["shutdown"] == 2


@pytest.mark.parametrize("wait, host_alone, loop_timed", [(2, [], [1]), (3, [1], [2]), (4, [1], [2, 3]),
                                                           (5, [1, 2], [3, 4]), (7, [1, 2, 3], [4, 5, 6]),
                                                           (9, [1, 2, 3], [4, 5, 6, 7, 8])])
def test_which_wait_steps_time_the_host_alone(monkeypatch, wait, host_alone, loop_timed):
    """Up to three wait steps after the warm-up one are timed on the host alone, never more than are left to
    time the loop's step; the host's step is the fastest of them. A fake clock and CUDA stand in for a GPU."""
    from profiler_svc.agent import step_timer

    clock = [0.0]
    synchronized = []
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(step_timer.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(step_timer.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(step_timer.torch.cuda, "synchronize", lambda: synchronized.append(len(timer.steps)))
    monkeypatch.setattr(step_timer.StepTimer, "_event", staticmethod(lambda: None))  # wall clock for the loop
    timer = step_timer.StepTimer(host_steps=step_timer.host_alone_steps(wait))
    host_ms = [9.0, 7.0, 8.0, 6.0, 5.0]
    read_clock = []  # the steps after which capture reads the GPU's clock
    for index in range(wait):
        timer.begin(profiled=False)
        clock[0] += (host_ms[index - 1] if index in host_alone else 10.0) / 1e3
        if timer.end():
            read_clock.append(index)
    summary = timer.summary()
    assert synchronized == host_alone and read_clock == loop_timed
    assert summary["step_indices"] == [0] + loop_timed
    assert summary["host_steps_us"] == pytest.approx([host_ms[i - 1] * 1e3 for i in host_alone])
    assert summary["host_step_us"] == (pytest.approx(min(host_ms[:len(host_alone)]) * 1e3) if host_alone else None)
