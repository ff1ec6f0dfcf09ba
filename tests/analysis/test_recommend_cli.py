"""`profiler_svc recommend`: formats, exit codes, and bad input (one line, exit 2, no traceback)."""
import gzip
import json
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from profiler_svc.cli import main
from tests.plugins.traces import DATA, fixture_dir, fixture_path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_contract(capsys):
    code, out, err = run(capsys, "recommend", str(fixture_path("gpt2_fp16_train")), "--format", "json", "--top", "5")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["schema"] == "profiler_svc.report/1"
    assert {"device", "span_us", "gpu_busy_pct"} <= set(report["trace"])
    assert len(report["findings"]) == 5 and len(report["top_kernels"]) == 5
    for f in report["findings"]:
        assert f["category"] in ("fallback_kernel", "unfused_chain", "misalignment", "launch_gaps", "host_sync")
        assert set(f) >= {"id", "category", "severity", "title", "detail", "evidence", "saving_us_per_step",
                          "gpu_time_saved_us_per_step", "share_of_step_pct", "recommendation"}
        assert set(f["recommendation"]) == {"summary", "swap", "snippet", "fix", "slows_step"}
    k = report["top_kernels"][0]
    assert k["share_pct"] > 0 and k["count"] >= 1 and "op" in k and "module" in k


def test_text_and_markdown(capsys):
    code, out, _ = run(capsys, "recommend", str(fixture_path("llama_bf16_train")))
    assert code == 0 and "eager RMSNorm" in out and "[swap: rms_norm]" in out and "Top kernels" in out
    code, out, _ = run(capsys, "recommend", str(fixture_path("llama_bf16_train")), "--format", "markdown")
    assert code == 0 and out.startswith("## profiler_svc report") and "| # | severity |" in out and "```python" in out


def test_fail_on(capsys):
    path = str(fixture_path("gpt2_fp32_notf32_infer"))
    assert run(capsys, "recommend", path, "--fail-on", "high")[0] == 1
    clean = str(fixture_path("cpu_transformer_encoder_infer"))
    assert run(capsys, "recommend", clean, "--fail-on", "info")[0] == 0


def test_output_file(tmp_path, capsys):
    target = tmp_path / "report.json"
    code, out, _ = run(capsys, "recommend", str(fixture_path("bert_fp16_odd_hidden_infer")), "--format", "json",
                       "-o", str(target))
    assert code == 0 and out == "" and json.loads(target.read_text())["findings"]


def test_output_goes_where_the_path_points_and_keeps_what_is_there(tmp_path, capsys):
    """-o writes through a symlink to its target, keeps a file's mode, writes a device in place, and refuses the
    trace itself: it never replaces what is at the path with something else."""
    trace = str(fixture_path("bert_fp16_odd_hidden_infer"))
    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target.name)
    assert run(capsys, "recommend", trace, "-o", str(link))[0] == 0
    assert link.is_symlink() and target.read_text().startswith("profiler_svc report")
    assert target.stat().st_mode & 0o777 == 0o640
    pipe, read = tmp_path / "pipe", []  # not a regular file: written in place (as /dev/null would be), not replaced
    os.mkfifo(pipe)
    reader = threading.Thread(target=lambda: read.append(pipe.read_text()))
    reader.start()
    assert run(capsys, "recommend", trace, "-o", str(pipe))[0] == 0
    reader.join(timeout=30)
    assert stat.S_ISFIFO(pipe.stat().st_mode) and read[0].startswith("profiler_svc report")
    copy = tmp_path / "trace.json.gz"
    copy.write_bytes(fixture_path("bert_fp16_odd_hidden_infer").read_bytes())
    code, _, err = run(capsys, "recommend", str(copy), "-o", str(copy))
    assert code == 2 and "is the trace being analysed" in err
    assert copy.read_bytes() == fixture_path("bert_fp16_odd_hidden_infer").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "pipe", "target.txt", "trace.json.gz"]  # no temp left
    # a folder's rank file, or a new .json beside them (the next run would read it as a rank): refused
    folder = tmp_path / "ranks"
    shutil.copytree(fixture_dir("llama_nccl_ddp"), folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for name in (sorted(before)[0], "report.json"):
        code, _, err = run(capsys, "recommend", str(folder), "-o", str(folder / name))
        assert code == 2 and "of the folder being analysed" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line(tmp_path):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "recommend",
                               str(fixture_path("bert_fp16_odd_hidden_infer"))], stdout=full, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "No space left" in proc.stderr


def test_an_error_naming_a_hostile_path_stays_one_clean_line(tmp_path, capsys):
    bad = tmp_path / "two\nlines\x1b[31m.json"
    bad.write_text("not json")
    code, _, err = run(capsys, "recommend", str(bad))
    assert code == 2 and err.count("\n") == 1 and "\x1b" not in err


def _bad_inputs(tmp_path):
    good = gzip.decompress(fixture_path("bert_fp16_odd_hidden_infer").read_bytes())
    cases = {
        "missing": (tmp_path / "nope.json", None, "no such file"),
        "empty": (tmp_path / "empty.json", b"", "empty"),
        "not json": (tmp_path / "text.json", b"hello world", "not JSON"),
        "truncated json": (tmp_path / "cut.json", good[: len(good) // 2], "truncated"),
        "truncated gzip": (tmp_path / "cut.json.gz", gzip.compress(good)[:5000], "truncated"),
        "broken gzip": (tmp_path / "bad.json.gz", b"\x1f\x8b" + b"\x00garbage" * 20, "gzip"),
        "wrong type": (tmp_path / "type.json", json.dumps(
            {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1}]}).encode(), "ts"),
        "events not a list": (tmp_path / "obj.json", b'{"traceEvents": {"a": 1}}', "traceEvents"),
        "no events key": (tmp_path / "nokey.json", b'{"schemaVersion": 1}', "traceEvents"),
        "negative duration": (tmp_path / "neg.json", json.dumps(
            {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": -5}]}).encode(), "negative"),
        "empty folder": (tmp_path / "emptydir", "dir", "no trace files"),
    }
    for path, content, _ in cases.values():
        if content == "dir":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
    return cases


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    for label, (path, _, expect) in _bad_inputs(tmp_path).items():
        code, out, err = run(capsys, "recommend", str(path))
        lines = err.strip().splitlines()
        assert code == 2, label
        assert len(lines) == 1 and lines[0].startswith("profiler_svc: error:"), (label, err)
        assert expect.lower() in lines[0].lower(), (label, lines[0])
        assert out == ""


def test_size_limit(tmp_path):
    big = tmp_path / "big.json.gz"
    big.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 5_000_000 + b"]}"))
    proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "recommend", str(big)], capture_output=True,
                          text=True, env={"PROFILER_SVC_MAX_TRACE_BYTES": "1000000", "PATH": ""})
    assert proc.returncode == 2 and "limit" in proc.stderr and "Traceback" not in proc.stderr


def test_no_traceback_from_the_real_command(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "args": "oops"}]}')
    proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "recommend", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["recommend", "t.json", "--top", "zero"], "argument --top: not a whole number: 'zero'"),
    (["recommend", "t.json", "--top", "0"], "argument --top: must be at least 1"),
    (["recommend"], "the following arguments are required: TRACE"),
    (["bogus"], "invalid choice: 'bogus'")])
def test_usage_errors_are_one_line_and_exit_2(capsys, args, message):
    """argparse printed its usage block above the error: four lines, where every other error is one."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err and err.rstrip().endswith("-h)")


@pytest.mark.parametrize("setting, message", [
    ({"PROFILER_SVC_MAX_TRACE_BYTES": "abc"}, "PROFILER_SVC_MAX_TRACE_BYTES='abc' is not a whole number"),
    ({"PROFILER_SVC_MAX_TRACE_BYTES": "-1"}, "PROFILER_SVC_MAX_TRACE_BYTES=-1 is below its least value"),
])
def test_a_bad_setting_is_one_line_naming_it(setting, message):
    proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "recommend", str(fixture_path("gpt2_fp16_train"))],
                          capture_output=True, text=True, env={**os.environ, **setting})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_bad_size_setting_fails_reading_a_trace_not_importing_the_package():
    """A library user's `import profiler_svc` (and the service's modules) must not raise on a bad setting that
    only reading a trace uses; reading one says what is wrong, in one line."""
    code = ("import profiler_svc, profiler_svc.trace.load as load, profiler_svc.storage.ingest, profiler_svc.web\n"
            "try:\n    load.max_trace_bytes()\nexcept profiler_svc.errors.UserError as err:\n    print(err)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PROFILER_SVC_MAX_TRACE_BYTES": "8GB"})
    assert proc.returncode == 0 and proc.stdout == "PROFILER_SVC_MAX_TRACE_BYTES='8GB' is not a whole number\n", proc.stderr


def test_a_data_folder_that_is_a_file_is_one_line(tmp_path):
    home = tmp_path / "not-a-folder"
    home.write_text("")
    proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "db", "upgrade"], capture_output=True, text=True,
                          env={**os.environ, "PROFILER_SVC_HOME": str(home), "PROFILER_SVC_DATABASE_URL": ""})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "PROFILER_SVC_HOME: cannot use" in proc.stderr


def test_a_negative_worker_count_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--analysis-workers", "-1"])
    assert exc.value.code == 2 and "must be 0 or more" in capsys.readouterr().err


def test_a_name_with_line_breaks_cannot_forge_a_line(tmp_path, capsys):
    """A kernel name holding a line break stays on its line: in text, a forged finding row; in markdown, a table
    row cut in two."""
    forged = "FORGED 99 high saves 99.00 ms"
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 0, "dur": 50,
               "args": {"External id": 1}}]
    events += [{"ph": "X", "cat": "kernel", "name": f"vectorized_kernel\n{forged}\r\n| x |", "pid": 0, "tid": 7,
                "ts": 10 + i * 10, "dur": 5, "args": {"External id": 1, "stream": 7, "correlation": 100 + i}}
               for i in range(3)]
    path = tmp_path / "lines.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for fmt in ("text", "markdown"):
        _, out, _ = run(capsys, "recommend", str(path), "--format", fmt)
        assert forged in out
        assert not [line for line in out.splitlines() if line.lstrip("| ").startswith(("FORGED", "x |"))], out


def test_hostile_names_are_inert(tmp_path, capsys):
    name = "<img src=x onerror=alert`1`>\x1b[2J|evil"
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 0, "dur": 50,
               "args": {"External id": 1}}]
    events += [{"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": 10 + i * 10, "dur": 5,
                "args": {"External id": 1, "stream": 7, "correlation": 100 + i}} for i in range(3)]
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps({"traceEvents": events}))
    _, text, _ = run(capsys, "recommend", str(path))
    _, md, _ = run(capsys, "recommend", str(path), "--format", "markdown")
    assert "\x1b" not in text and "\\|evil" in md
    # markdown shows a code span literally, so a name inside one needs no escaping; anywhere else it is escaped
    for line in md.splitlines():
        for i, part in enumerate(line.split("`")):
            assert i % 2 == 1 or "<img" not in part, line
    _, js, _ = run(capsys, "recommend", str(path), "--format", "json")
    assert json.loads(js)["top_kernels"][0]["name"] == name  # JSON keeps the data exact


def test_gpu_work_the_analysis_leaves_out_is_said(tmp_path, capsys):
    """A real trace with its GPU clock 1 s behind the host's: every kernel falls outside the steps. The report
    says so (and so do the loader's own warnings) instead of a quiet "no GPU kernels"."""
    data = json.loads(gzip.decompress(fixture_path("llama_bf16_compiled_infer").read_bytes()))
    kernels = [e for e in data["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for e in kernels:
        e["ts"] -= 1_000_000
    data["traceEvents"].append({"ph": "B", "name": "never closed", "pid": 1, "tid": 1, "ts": 0})
    path = tmp_path / "offset.json"
    path.write_text(json.dumps(data))
    code, out, _ = run(capsys, "recommend", str(path), "--format", "json")
    warnings = json.loads(out)["trace"]["warnings"]
    assert code == 0 and any("lie outside the analysed steps" in w for w in warnings)
    assert any("'B' events without an 'E'" in w for w in warnings)
    _, text, _ = run(capsys, "recommend", str(path))
    assert text.splitlines()[2].startswith("warning: ")
    _, clean_text, _ = run(capsys, "recommend", str(fixture_path("llama_bf16_compiled_infer")))
    assert "warning:" not in clean_text


def _rank_file(folder, name, rank, host_us=50):
    """A tiny per-rank trace (one op, three kernels) that names RANK in torch.distributed's metadata."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": host_us,
               "args": {"External id": 1}}]
    events += [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10 + 10 * i, "dur": 5,
                "args": {"External id": 1, "stream": 7, "correlation": 100 + i}} for i in range(3)]
    (folder / name).write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank, "world_size": 2}}))


def test_every_ranks_warnings_are_said(tmp_path, capsys):
    _rank_file(tmp_path, "a.json", 0)
    _rank_file(tmp_path, "b.json", 1)
    data = json.loads((tmp_path / "b.json").read_text())
    data["traceEvents"].append({"ph": "B", "name": "never closed", "pid": 1, "tid": 1, "ts": 0})
    (tmp_path / "b.json").write_text(json.dumps(data))
    code, out, _ = run(capsys, "recommend", str(tmp_path), "--format", "json")
    assert code == 0 and json.loads(out)["trace"]["warnings"] == ["rank 1: 1 'B' events without an 'E' on their thread ignored"]


def test_a_folder_naming_one_rank_twice_is_refused(tmp_path, capsys):
    _rank_file(tmp_path, "a.json", 0)
    _rank_file(tmp_path, "b.json", 0)
    code, out, err = run(capsys, "recommend", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1 and "a.json and b.json are both rank 0" in err


def test_a_folder_of_one_process_windows_is_no_job(tmp_path, capsys):
    """tensorboard_trace_handler writes a file a profiling window: two windows of a single-GPU run were read as
    ranks 0 and 1, and the report named a straggler ("rank 1 straggles", high) with advice to balance the ranks."""
    with gzip.open(fixture_path("gpt2_fp32_notf32_infer")) as f:
        data = json.load(f)
    for window, later_us in (("host_1.100.pt.trace.json.gz", 0), ("host_1.200.pt.trace.json.gz", 100_000)):
        for e in data["traceEvents"]:
            if "ts" in e:
                e["ts"] += later_us  # the second window, 100 ms after the first began (it lasts 13 ms)
        (tmp_path / window).write_bytes(gzip.compress(json.dumps(data).encode()))
    code, out, err = run(capsys, "recommend", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert ("host_1.100.pt.trace.json.gz and host_1.200.pt.trace.json.gz name no rank and come from one process "
            "(pid 420) at different times") in err


def test_unnamed_ranks_that_share_a_pid_but_run_at_once_are_a_job(tmp_path, capsys):
    """Ranks in containers each run as pid 1: traces that name no rank, one pid, the same time are ranks."""
    for rank in (0, 1):
        with gzip.open(DATA / "llama_nccl_ddp" / f"llama_nccl_ddp_rank{rank}.json.gz") as f:
            data = json.load(f)
        data.pop("distributedInfo")
        data.pop("profiler_svc")  # capture's metadata names the rank too
        for e in data["traceEvents"]:
            if isinstance(e.get("pid"), int) and e["pid"] > 64:  # the host's pid (the GPU side's are devices)
                e["pid"] = 1
        (tmp_path / f"r{rank}.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    code, out, err = run(capsys, "recommend", str(tmp_path), "--format", "json")
    assert code == 0, err
    assert [r["rank"] for r in json.loads(out)["ranks"]] == [0, 1]


@pytest.mark.parametrize("bad", [2 ** 63, -5, True, "1", 1.5, None])
def test_a_rank_that_cannot_be_one_takes_a_free_rank(tmp_path, capsys, bad):
    """A peer host without CUDA runtime calls (host pace 0) beside it, as a hand-made pair had: no division by 0."""
    _rank_file(tmp_path, "a.json", 0, host_us=50)
    _rank_file(tmp_path, "b.json", bad, host_us=1000)
    code, out, err = run(capsys, "recommend", str(tmp_path), "--format", "json")
    assert code == 0 and err == "", err
    assert sorted(r["rank"] for r in json.loads(out)["ranks"]) == [0, 1]


def test_python_api():
    import profiler_svc
    report = profiler_svc.recommend(fixture_path("qwen2_bf16_decode"))
    assert isinstance(report, profiler_svc.Report) and report.findings[0].category == "launch_gaps"
    assert "rms_norm" in report.swaps()


def test_the_text_says_how_many_findings_the_table_left_out(capsys):
    """T5 training has 17 findings; the table shows 10 and the combined prediction counts every one: the text said
    nothing of the other 7."""
    path = str(fixture_path("t5_bf16_train"))
    code, out, _ = run(capsys, "recommend", path, "--format", "json", "--top", "100")
    total = len(json.loads(out)["findings"])
    assert total > 10
    code, out, _ = run(capsys, "recommend", path)
    assert code == 0 and f"and {total - 10} more (--top {total} shows every one)" in out
    code, out, _ = run(capsys, "recommend", path, "--top", str(total))
    assert "more (--top" not in out
    code, out, _ = run(capsys, "recommend", path, "--format", "markdown")
    assert f"And {total - 10} more" in out


def test_a_folder_with_a_cpu_only_rank_is_headed_by_a_rank_with_gpu_work(tmp_path):
    """A CPU-only trace as rank 0 beside a GPU rank: the headline (device, step, prediction) is the GPU rank's, and
    the header says which rank it is; it was rank 0's: "device unknown, GPU busy 0.0%", no prediction."""
    from profiler_svc.recommendations import recommend
    from profiler_svc.recommendations.report import render_text
    shutil.copy(fixture_path("cpu_compiled_mlp_infer"), tmp_path / "a_rank0.json.gz")
    shutil.copy(fixture_path("llama_bf16_compiled_infer"), tmp_path / "b_rank1.json.gz")
    r = recommend(tmp_path)
    gpu = recommend(fixture_path("llama_bf16_compiled_infer"))
    assert r.source["ranks"] == [0, 1]
    assert r.trace["device"]["name"] == gpu.trace["device"]["name"] == "NVIDIA H200"
    assert r.steps["step_us"] == gpu.steps["step_us"] and r.prediction["step_us"] == gpu.prediction["step_us"]
    assert "step and prediction below: rank 1" in render_text(r)
    assert r.predict(fixes=["cuda_graphs"])["step_us"] == gpu.prediction["step_us"]
