"""Same numbers everywhere: for the same trace, `recommend` as text, JSON and markdown and the dashboard's pages
show the same step, prediction, savings and trace figures."""
import html
import json
import re

import pytest

from profiler_svc.cli import main
from profiler_svc.formats import fmt_us
from profiler_svc.storage.ingest import ingest_path
from tests.plugins.traces import DDP, fixture_dir, fixture_path
from tests.web.test_web import make_app

TOP = 10


def cli(capsys, trace, fmt) -> str:
    assert main(["recommend", str(trace), "--format", fmt, "--top", str(TOP)]) == 0
    return capsys.readouterr().out


def visible(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


@pytest.mark.parametrize("trace", [fixture_path("llama_bf16_train_agent"), DDP, fixture_dir("llama_nccl_ddp")],
                         ids=["labelled", "two ranks", "two ranks over NCCL"])
def test_cli_json_markdown_and_dashboard_agree(capsys, engine, blobs, trace):
    report = json.loads(cli(capsys, trace, "json"))
    text, table, markdown = cli(capsys, trace, "text"), cli(capsys, trace, "table"), cli(capsys, trace, "markdown")
    assert table == text  # --format table is the text table

    run_id = ingest_path(engine, trace, blobs=blobs)[0].run_id
    client = make_app(engine, blobs, PUBLIC_READ=True).test_client()
    api = client.get(f"/api/v1/runs/{run_id}").get_json()
    run_page = visible(client.get(f"/runs/{run_id}").get_data(as_text=True))
    modules_page = visible(client.get(f"/runs/{run_id}/modules").get_data(as_text=True))

    steps, prediction, t = report["steps"], report["prediction"], report["trace"]
    figures = [fmt_us(steps["step_us"]["median"]), fmt_us(prediction["step_us"]), fmt_us(prediction["step_us_after"]),
               f"{t['gpu_busy_pct']:.1f}"]
    for f in report["findings"]:  # a fix that lengthens the step reads "slows the step by" its figure
        figures.append(fmt_us(abs(f["saving_us_per_step"])))
    for shown in (text, markdown, run_page):
        missing = [x for x in figures if x not in shown]
        assert not missing, missing
    assert f"{prediction['saving_pct']:.1f}% shorter" in text and f"{prediction['saving_pct']:.1f} % shorter" in run_page

    # the JSON mirror of the page carries the report's own numbers
    assert api["analysis"]["steps"]["step_us"] == steps["step_us"]
    assert api["analysis"]["prediction"]["step_us_after"] == prediction["step_us_after"]
    assert [f["saving_us_per_step"] for f in api["findings"][:TOP]] == [f["saving_us_per_step"] for f in report["findings"]]
    assert api["analysis"]["trace"]["kernel_count"] == t["kernel_count"]
    assert f"kernels {t['kernel_count']} " in text and f"{t['kernel_count']} kernels" in run_page
    # top kernels: the same short names, time per step and share as the CLI's table
    for k in report["top_kernels"][:TOP]:
        for shown in (text, modules_page):
            assert fmt_us(k["us_per_step"]) in shown and f"{k['share_pct']:.1f}" in shown
        assert k["short_name"][:60] in modules_page
