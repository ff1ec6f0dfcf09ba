"""`profiler_svc ab`: a tiny workload with a real bundled swap, swaps from a real report, bad input."""
import json
import shutil

import pytest

from ab_swaps import needs_kernels
from profiler_svc.ab.commands import recommended_in_report, swaps_from_report
from profiler_svc.cli import main
from tests.plugins.traces import fixture_path


QUICK = ["--rounds", "3", "--warmup", "1"]


def _ab(capsys, *args):
    code = main(["ab", *args])
    out, err = capsys.readouterr()
    return code, out, err


@needs_kernels
@pytest.mark.parametrize("train", [False, True])
def test_ab_json_on_a_workload(capsys, train):
    workload = "ab_workloads:mlp_train" if train else "ab_workloads:mlp"
    code, out, err = _ab(capsys, "--workload", workload, "--swap", "rms_norm", "--json", *QUICK,
                         *(["--train"] if train else []))
    assert code == 0, err
    result = json.loads(out)
    assert result["schema"] == "profiler_svc.ab/1" and result["train"] is train
    assert result["swapped"] == [{"module": "norm", "class": "RMSNorm", "swap": "rms_norm"}]
    assert result["parity_passed"] and result["verdict"] in {"faster", "slower", "no_difference"}
    assert len(result["timing"]["a_ms"]) == 3
    names = {row["name"] for row in result["parity"]}
    assert ("loss" in names and "grad.norm.weight" in names) if train else names == {"output"}


@needs_kernels
def test_ab_text_summary(capsys):
    code, out, _ = _ab(capsys, "--workload", "ab_workloads:mlp", "--swap", "rms_norm", *QUICK)
    assert code == 0
    assert "swapped: rms_norm x1" in out and "parity vs fp64: passed" in out and "verdict: " in out


def test_swaps_from_a_real_report(tmp_path, capsys):
    """`recommend --format json` on a real H100 trace of a Llama training step, then its swaps."""
    assert main(["recommend", str(fixture_path("llama_bf16_train")), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    expected = list(dict.fromkeys(f["recommendation"]["swap"] for f in report["findings"]
                                  if f["recommendation"]["swap"] and not f["recommendation"]["slows_step"]))
    assert "rms_norm" in expected  # an eager Llama's RMSNorm chain is there to be found
    assert swaps_from_report(path) == expected
    # swaps the replay says slow this step are named in their findings, and not taken
    slowing = {f["recommendation"]["swap"] for f in report["findings"] if f["recommendation"]["slows_step"]}
    assert slowing and not slowing & set(swaps_from_report(path))


@needs_kernels
def test_ab_from_report(tmp_path, capsys):
    report = {"schema": "profiler_svc.report/1", "findings": [
        {"recommendation": {"summary": "x", "swap": None}},
        {"recommendation": {"summary": "y", "swap": "rms_norm"}},
        {"recommendation": {"summary": "z", "swap": "rms_norm"}},
    ]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    code, out, err = _ab(capsys, "--workload", "ab_workloads:mlp", "--from-report", str(path), "--json", *QUICK)
    assert code == 0, err
    assert json.loads(out)["swaps"] == ["rms_norm"]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--workload", "nocolon", "--swap", "rms_norm"], "must look like 'pkg.module:factory'"),
    (["--workload", "ab_no_such_module:f", "--swap", "rms_norm"], "cannot import workload module"),
    (["--workload", "ab_workloads:nothing", "--swap", "rms_norm"], "has no callable 'nothing'"),
    (["--workload", "ab_workloads:not_a_workload", "--swap", "rms_norm"], "must return (model, inputs)"),
    (["--workload", "ab_workloads:mlp"], "nothing to test: give --swap NAME, --fix NAME"),
    (["--workload", "ab_workloads:mlp", "--swap", "no_such_swap"], "unknown swap 'no_such_swap'; available: "),
    (["--workload", "ab_workloads:mlp", "--swap", "rms_norm", "--rounds", "1"], "rounds must be a whole number >= 2"),
    (["--workload", "ab_workloads:mlp", "--from-report", "/no/such/report.json"], "does not exist"),
    (["--workload", "ab_workloads:mlp", "--from-report", "{tmp}/bad.json"], "cannot read report"),
    (["--workload", "ab_workloads:mlp", "--from-report", "{tmp}/other.json"], "is not a `profiler_svc recommend"),
    (["--workload", "ab_workloads:mlp", "--from-report", "{tmp}/empty.json"], "recommends no bundled swap or fix"),
    (["--workload", "ab_workloads:mlp", "--fix", "tf33"], "unknown fix 'tf33'; available: tf32, bf16_autocast"),
    (["--workload", "ab_workloads:mlp", "--fix", "pad_vocab"], "nothing of pad_vocab applies to MLP"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    _write(tmp_path, "bad.json", "{not json")
    _write(tmp_path, "other.json", json.dumps({"schema": "something/1"}))
    _write(tmp_path, "empty.json", json.dumps({"schema": "profiler_svc.report/1", "findings": []}))
    code, out, err = _ab(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("profiler_svc: error: ") and message in err


@needs_kernels
def test_model_failure_is_one_line_exit_2(capsys):
    # mlp's output is not a scalar and has no .loss: training it without a loss_fn is a user error
    code, out, err = _ab(capsys, "--workload", "ab_workloads:mlp", "--swap", "rms_norm", "--train", *QUICK)
    assert code == 2 and err.count("\n") == 1 and "needs a scalar loss" in err



@needs_kernels
def test_result_is_stored_when_a_database_is_configured(tmp_path, monkeypatch, capsys):
    from profiler_svc.storage import db as storage_db
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import ABJob

    url = f"sqlite:///{tmp_path / 'ab.sqlite3'}"  # the zero-set-up SQLite file: migrated on first use
    monkeypatch.setenv("PROFILER_SVC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", url)
    try:
        code, out, err = _ab(capsys, "--workload", "ab_workloads:mlp", "--swap", "rms_norm", "--json", *QUICK)
        assert code == 0 and err.strip() == "stored as A/B job 1"
        with session_scope(storage_db.get_engine(url)) as s:
            job = s.get(ABJob, 1)
            assert job.status == "done" and job.workload == "ab_workloads:mlp" and job.swap == "rms_norm"
            assert job.result.result == json.loads(out) and job.params["rounds"] == 3
            assert job.run.workload == "ab_workloads:mlp"
    finally:
        storage_db._engines.pop(url).dispose()

    # a configured database that cannot take the result: the result is still printed, then exit 2
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    code, out, err = _ab(capsys, "--workload", "ab_workloads:mlp", "--swap", "rms_norm", *QUICK)
    assert code == 2 and "verdict: " in out
    assert err.count("\n") == 1 and "cannot open the database" in err and "Connection refused" in err


def test_fixes_from_the_cli_with_an_optimizer_and_a_tolerance(capsys):
    """Every exact fix a transformer's training step can take, at once, on a workload with its optimizer."""
    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--train", "--json",
                         "--fix", "sdpa", "--fix", "pad_vocab", "--fix", "fused_optimizer", *QUICK)
    assert code == 0, err
    result = json.loads(out)
    assert result["fixes"] == ["sdpa", "pad_vocab", "fused_optimizer"] and result["swaps"] == []
    assert [row["fix"] for row in result["fixes_applied"]] == result["fixes"]
    names = {row["name"] for row in result["parity"]}
    assert {"loss", "grad.lm_head.weight", "param.lm_head.weight"} <= names  # the optimizer's step is checked
    assert result["parity_passed"] and {row["gate"] for row in result["parity"]} == {"strict"}

    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--train", "--fix",
                         "bf16_autocast", "--max-rel-error", "1e-6", *QUICK)
    assert code == 1 and "numeric cost vs fp64" in out and "OVER on" in out and "tolerance 1e-06" in out


def test_from_report_takes_fixes_and_swaps(tmp_path, capsys):
    report = {"schema": "profiler_svc.report/1", "source": {"path": str(tmp_path / "gone.json")}, "findings": [
        {"recommendation": {"summary": "x", "swap": None, "fix": "sdpa"}},
        {"recommendation": {"summary": "y", "swap": "rms_norm", "fix": None}},
        {"recommendation": {"summary": "z", "swap": None, "fix": "pad_vocab"}},
    ]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert recommended_in_report(path) == {"swaps": ["rms_norm"], "fixes": ["sdpa", "pad_vocab"]}
    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--from-report", str(path),
                         "--fix", "tf32", "--train", "--json", *QUICK)
    result = json.loads(out)
    assert result["fixes"] == ["tf32", "sdpa", "pad_vocab"] and result["swaps"] == ["rms_norm"]
    assert "no prediction: the report's trace" in err and result["prediction"] is None


def test_a_queued_job_carries_fixes_and_the_worker_applies_them(engine, blobs):
    """A/B job params carry the fixes (no schema change); `profiler_svc worker` runs them with the swap."""
    from profiler_svc.service import worker
    from profiler_svc.storage import jobs
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.ingest import ingest_path
    from profiler_svc.storage.models import ABJob, Run
    from tests.plugins.traces import SMALL_TRACE

    [ingested] = ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="ab_workloads:llama_train_adamw")
    with session_scope(engine) as s:
        job = jobs.enqueue(s, s.get(Run, ingested.run_id), params={"fixes": ["sdpa", "fused_optimizer"],
                                                                    "rounds": 2, "warmup": 0})
        job_id = job.id
        assert job.swap == "sdpa, fused_optimizer" and job.params["swaps"] == []
    assert worker.work_once(engine, worker="w1") == job_id
    with session_scope(engine) as s:
        job = s.get(ABJob, job_id)
        assert job.status == "done", job.error
        result = job.result.result
    assert result["train"] is True  # the workload brings an optimizer: its step is a training step
    assert [row["fix"] for row in result["fixes_applied"]] == ["sdpa", "fused_optimizer"]
    assert result["parity_passed"] and any(row["name"].startswith("param.") for row in result["parity"])


@needs_kernels
def test_from_report_predicts_what_ran(tmp_path, capsys):
    """The Llama sample's report names rms_norm, rope, cuda_graphs and fused_optimizer; on this CPU workload
    cuda_graphs does not apply. The prediction was made for all four before the test, so it counted a fix that
    never ran."""
    from profiler_svc.recommendations import recommend

    trace = str(fixture_path("llama_bf16_train"))
    assert main(["recommend", trace, "--format", "json"]) == 0
    report = tmp_path / "report.json"
    report.write_text(capsys.readouterr()[0])
    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--from-report", str(report),
                         "--train", "--json", *QUICK)
    assert code == 0, err
    result = json.loads(out)
    ran = list(dict.fromkeys(row["swap"] for row in result["swapped"]))
    applied = [row["fix"] for row in result["fixes_applied"]]
    assert "cuda_graphs" in result["fixes"] and "cuda_graphs" not in applied and ran
    expected = recommend(trace).predict(swaps=ran, fixes=applied)
    assert result["prediction"]["findings"] == expected["findings"]
    assert result["prediction"]["saving_us_per_step"] == expected["saving_us_per_step"]
    assert not any(key.startswith("launch_gaps") for key in result["prediction"]["findings"])


def test_a_reports_relative_trace_path_is_found_beside_the_report(tmp_path, capsys):
    """`recommend trace.json.gz > report.json` in one folder, `ab --from-report DIR/report.json` from another: the
    report's relative path named no file, and the A/B ran without a prediction."""
    from profiler_svc.ab.commands import predicted_change, report_trace

    shutil.copy(fixture_path("gpt2_fp32_notf32_infer"), tmp_path / "gpt2.json.gz")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": "profiler_svc.report/1", "source": {"path": "gpt2.json.gz"},
                                  "findings": []}))
    prediction = predicted_change(report_trace(report), [], ["tf32"])
    assert capsys.readouterr()[1] == "" and prediction["saving_us_per_step"] > 0


@pytest.mark.parametrize("source", ["trace.json", ["trace.json"]])
def test_a_report_with_a_malformed_source_is_one_line_exit_2(tmp_path, capsys, source):
    """A report's "source" names the trace to predict from; a string or list there was a traceback, exit 1,
    after the workload had loaded."""
    report = _write(tmp_path, "report.json", json.dumps({
        "schema": "profiler_svc.report/1", "source": source,
        "findings": [{"recommendation": {"summary": "x", "swap": "rms_norm", "fix": None}}]}))
    code, out, err = _ab(capsys, "--workload", "ab_workloads:not_a_workload", "--from-report", report, *QUICK)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "has a malformed source: an object with the trace's path expected" in err


@pytest.mark.parametrize("fix", ["fused_optimizer", "bundled_adamw"])
def test_an_optimizer_fix_without_train_says_train_is_missing(capsys, fix):
    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--fix", fix, *QUICK)
    assert code == 2 and err.count("\n") == 1 and f"--fix {fix} needs --train" in err


def test_the_bundled_adamw_from_the_cli_keeps_the_optimizer_s_parity(capsys, monkeypatch):
    """B steps the workload's torch AdamW with the bundled kernel; the parameters after the step are judged."""
    from profiler_svc.kernels import adamw
    stepped = []
    real = adamw.adamw_step
    monkeypatch.setattr(adamw, "adamw_step", lambda *a, **k: (stepped.append(1), real(*a, **k)))
    code, out, err = _ab(capsys, "--workload", "ab_workloads:llama_train_adamw", "--train", "--json",
                         "--fix", "bundled_adamw", *QUICK)
    assert code == 0, err
    result = json.loads(out)
    assert [row["fix"] for row in result["fixes_applied"]] == ["bundled_adamw"]
    assert "profiler_svc.kernels.AdamW" in result["fixes_applied"][0]["note"]
    params = [row for row in result["parity"] if row["name"].startswith("param.")]
    assert params and result["parity_passed"] and stepped  # B's steps ran the kernel
