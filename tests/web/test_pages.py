"""The dashboard's views, server side: each shows what the analyser stored (the same figures as the report of
the same files), the answer first, evidence as tables, one finding per cause across ranks."""
import html
import json
import re

import numpy as np
import pytest

from profiler_svc.formats import fmt_us
from profiler_svc.recommendations import recommend
from profiler_svc.storage import queries
from profiler_svc.storage.ingest import ingest_path
from profiler_svc import intervals
from tests.plugins.traces import DDP, fixture_dir, fixture_path
from tests.web.test_web import TOKEN, csrf_token, make_app
from tests.web.uploads import sign_in

WORKLOAD = "profiler_svc.service.demo:tiny_llama"
LABELLED = fixture_path("llama_bf16_train_agent")  # captured with profiler_svc.capture: module labels


@pytest.fixture
def client(engine, blobs):
    client = make_app(engine, blobs).test_client()
    assert sign_in(client, TOKEN).status_code == 303
    return client


def ingest(engine, blobs, path, **kwargs) -> int:
    return ingest_path(engine, path, blobs=blobs, **kwargs)[0].run_id


def shown_level(level: float) -> str:
    """An interval's level as the pages show it: 95 %, 66.7 %."""
    return f"{round(100 * level, 1):g} %"


def text_of(page: str) -> str:
    """The page as a reader sees it: tags gone, entities decoded, whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_run_page_answers_first(engine, blobs, client):
    run_id = ingest(engine, blobs, LABELLED, workload=WORKLOAD)
    report = recommend(str(LABELLED)).to_dict()
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    steps, prediction = report["steps"], report["prediction"]
    answer = page[:page.index('id="findings"')]
    # the step, the step after every recommended fix, and the waterfall, before any finding
    assert fmt_us(steps["step_us"]["median"]) in text_of(answer)
    assert fmt_us(prediction["step_us_after"]) in text_of(answer)
    assert 'id="waterfall-chart"' in answer
    embedded = json.loads(re.search(r'id="waterfall-data">(.*?)</script>', page, re.S).group(1))
    assert embedded["waterfall"] == prediction["waterfall"] and embedded["step_us_after"] == prediction["step_us_after"]
    # findings ranked by realizable saving, each with the report's saving and share of the step
    shown = re.findall(r'<details class="finding[^"]*" id="finding-\d+"', page)
    assert len(shown) == len(report["findings"])
    titles = [html.unescape(t) for t in re.findall(r'<span class="title">(.*?)</span>', page)]
    assert titles == [f["title"] for f in report["findings"]]
    for f in report["findings"]:
        assert f"{f['share_of_step_pct']:.1f} %" in page or abs(f["share_of_step_pct"]) < 0.05
    # evidence as tables, never a JSON dump
    assert 'class="evidence-table"' in page and "\\u003c" not in page.split('id="waterfall-data"')[0]
    assert not re.search(r"<pre>\s*\{", page)
    # a value shows its own unit (µs, ms or s; %): no row or column is labelled in µs or pct beside it
    labels = re.findall(r'<th scope="row">(.*?)</th>', page) + re.findall(r"<thead><tr>(.*?)</tr></thead>", page)
    assert labels and not any(re.search(r"\b(us|pct)\b", label) for label in labels)
    first_kernel = next(f["evidence"]["kernels"][0] for f in report["findings"]
                        if isinstance(f["evidence"].get("kernels"), list))
    assert f"<code>{html.escape(first_kernel, quote=False)}" in page.replace("&#34;", '"').replace("&#39;", "'")
    # where the step goes: the analyser's breakdown per step
    for value in steps["breakdown_us_per_step"].values():
        assert fmt_us(value) in page


def test_run_page_names_the_fixes_left_out_of_the_combined_prediction(engine, blobs, client):
    """Real capture (one rank of a Llama DDP job, ingested alone): the rotary and cross-entropy fixes save alone
    but lengthen the step on top of the others, so the prediction leaves them out, and the page says which and
    by how much."""
    trace = fixture_dir("llama_nccl_ddp_straggler") / "llama_nccl_ddp_straggler_rank1.json.gz"
    run_id = ingest(engine, blobs, trace)
    prediction = recommend(str(trace)).to_dict()["prediction"]
    assert prediction["not_combined"]
    answer = text_of(client.get(f"/runs/{run_id}").get_data(as_text=True))
    answer = answer[:answer.index("Findings, by what they save per step")]
    assert "Left out of the combined prediction" in answer
    for left in prediction["not_combined"]:
        assert f"{left['title']} ({fmt_us(-left['saving_us_per_step'])} slower)" in answer
    assert fmt_us(prediction["step_us"]) in answer  # the replayed loop step the fixes start from


def _calibration_note_shown(engine, blobs, client, noted, quiet, key, element_id) -> str:
    """The run page of fixture NOTED as text, after checking it holds the analyser's calibration[KEY] note, and
    that fixture QUIET's page has no element ELEMENT_ID."""
    shown = ingest(engine, blobs, fixture_path(noted))
    other = ingest(engine, blobs, fixture_path(quiet))
    note = recommend(str(fixture_path(noted))).steps["calibration"][key]
    page = text_of(client.get(f"/runs/{shown}").get_data(as_text=True))
    assert note[1:] in page
    assert f'id="{element_id}"' not in client.get(f"/runs/{other}").get_data(as_text=True)
    return page


def test_run_page_says_how_far_apart_captures_timed_steps_were(engine, blobs, client):
    """Real capture (Mixtral inference, H100) whose unprofiled steps were timed 29% apart: the run page says so,
    in the analyser's words; a steady capture's page does not."""
    page = _calibration_note_shown(engine, blobs, client, "mixtral_bf16_1x256_infer", "gemma8_bf16_4x1024_train_pva",
                                   "spread_note", "calibration-spread")
    assert "less certain" in page


def test_run_page_says_when_the_power_cap_held_the_clock_down(engine, blobs, client):
    """Real H200 captures with the GPU's clocks: the training run, at its power cap, gets the analyser's note on
    its page; the inference run, at full clock, does not."""
    page = _calibration_note_shown(engine, blobs, client, "llama8_bf16_4x2048_train_h200_clocks",
                                   "llama8_bf16_4x2048_infer_h200_clocks", "power_note", "power-note")
    assert "upper bound" in page


def test_run_page_gives_the_saving_over_the_hosts_pace(engine, blobs, client):
    """Real captures: Llama training at the balanced size (H100) saves a host-pace-dependent amount, so its page
    gives the analyser's range beside the predicted step and its note; the GPU-bound H200 run's page does not."""
    path = fixture_path("llama8_bf16_4x1024_train_calibrated")
    prediction = recommend(str(path)).prediction
    low, high = prediction["saving_range_us"]
    slow, fast = prediction["step_range_us"]
    page = client.get(f"/runs/{ingest(engine, blobs, path)}").get_data(as_text=True)
    card = text_of(page[page.index('id="predicted-step"'):page.index('id="bottleneck"')])
    # each saving with the step it is of: a range alone read as savings above the step beside it
    assert f"with the host's pace: {fmt_us(low)} saved of a {fmt_us(slow)} step to {fmt_us(high)} of {fmt_us(fast)}" in card
    assert prediction["pace_note"].startswith(f"{fmt_us(low)} saved of a {fmt_us(slow)} step to {fmt_us(high)} of "
                                              f"{fmt_us(fast)}")
    assert prediction["pace_note"][1:] in text_of(page)
    quiet = ingest(engine, blobs, fixture_path("llama8_bf16_4x2048_train_h200_clocks"))
    assert 'id="pace-note"' not in client.get(f"/runs/{quiet}").get_data(as_text=True)
    # a stored prediction whose range is not two numbers (an edited row) still renders, without it
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import TraceRecord
    for junk in (None, "x", [1], ["a", "b"], {"low": 1}):
        with session_scope(engine) as s:
            record = s.query(TraceRecord).filter_by(run_id=quiet).one()
            record.prediction = {**record.prediction, "pace_note": "a note", "saving_range_us": junk}
        page = client.get(f"/runs/{quiet}")
        assert page.status_code == 200 and 'id="pace-range"' not in page.get_data(as_text=True)


def test_run_page_states_the_unprofiled_step_and_fixes_that_slow_it(engine, blobs, client):
    """A calibrated capture (Llama 1x512, H100): the step card gave the profiled 68 ms beside "after all fixes"
    from the unprofiled 34 ms; it gives the unprofiled step, the profiled one beside it. A fix the replay says
    lengthens the step read "saves -106 us/step"."""
    path = fixture_path("llama8_bf16_1x512_train_calibrated")
    report = recommend(str(path)).to_dict()
    calibration = report["steps"]["calibration"]
    page = client.get(f"/runs/{ingest(engine, blobs, path)}").get_data(as_text=True)
    card = text_of(page[page.index('id="step-time"') - 200:page.index('id="predicted-step"')])
    assert f"Step, unprofiled {fmt_us(calibration['unprofiled_step_us'])}" in card
    assert f"profiled {fmt_us(report['steps']['step_us']['median'])}" in card
    assert "Bound by" not in text_of(page)
    sample = fixture_path("llama_bf16_train")  # its swiglu and cross-entropy swaps cost more host time than they save
    slower = [f for f in recommend(str(sample)).to_dict()["findings"] if f["saving_us_per_step"] < 0]
    page = text_of(client.get(f"/runs/{ingest(engine, blobs, sample)}").get_data(as_text=True))
    assert slower and "saves -" not in page
    for f in slower:
        assert f"slows the step by {fmt_us(-f['saving_us_per_step'])} /step" in page  # text_of: a tag, a space


def test_a_jobs_page_says_the_straggler_is_not_in_the_combined_prediction(engine, blobs, client):
    """The CLI says "not in that: rank 0 straggles ..." under the job's combined prediction; the page said nothing."""
    folder = fixture_dir("llama_nccl_ddp_4step")
    left = recommend(str(folder)).prediction["left_out"]
    run_id = ingest(engine, blobs, folder)
    page = text_of(client.get(f"/runs/{run_id}").get_data(as_text=True))
    assert left and all(f"Not in the combined prediction: {x['title']} ({x['why']})." in page for x in left)


def test_a_saving_the_replay_cannot_model_reads_as_an_upper_bound(engine, blobs, client):
    """A DataParallel capture (two GPUs, one process): its DDP fix is priced by its floor, "up to", and left out of
    the combined prediction, as the CLI says."""
    path = fixture_path("llama_bf16_data_parallel_train")
    report = recommend(str(path))
    bound = next(f for f in report.findings if f.step_floor_us is not None)
    page = text_of(client.get(f"/runs/{ingest(engine, blobs, path)}").get_data(as_text=True))
    assert f"saves up to {fmt_us(bound.saving_us_per_step)} /step" in page
    assert f"up to {fmt_us(bound.saving_us_per_step)} per step" in page
    assert f"Not in the combined prediction: {bound.title} ({report.prediction['left_out'][0]['why']})." in page


def test_runs_list_names_each_runs_top_finding(engine, blobs, client):
    labelled = ingest(engine, blobs, LABELLED)
    small = ingest(engine, blobs, fixture_path("llama_bf16_compiled_infer"))
    listing = client.get("/api/v1/runs").get_json()["runs"]
    page = client.get("/").get_data(as_text=True)
    for run_id, path in ((labelled, LABELLED), (small, fixture_path("llama_bf16_compiled_infer"))):
        top = recommend(str(path)).findings[0]
        row = next(r for r in listing if r["id"] == run_id)
        assert row["top_finding"]["title"] == top.title
        assert row["top_finding"]["saving_us_per_step"] == pytest.approx(top.saving_us_per_step, abs=0.01)
        assert html.escape(top.title, quote=False) in page and fmt_us(top.saving_us_per_step) in page
    # a page past the last says so, not "No runs. Ingest one"; a rank below 0 is no rank
    past = text_of(client.get("/?page=1000000").get_data(as_text=True))
    assert "No runs on page 1000000" in past and "Ingest one" not in past
    bad = client.get(f"/runs/{labelled}?rank=-1")
    assert bad.status_code == 400 and "must be in [0, 1048576]" in bad.get_data(as_text=True)


def test_multi_rank_run_is_one_finding_per_cause_with_each_ranks_figures(engine, blobs, client):
    run_id = ingest(engine, blobs, DDP, name="ddp")
    report = recommend(str(DDP)).to_dict()
    run = client.get(f"/api/v1/runs/{run_id}").get_json()
    # the same findings as `profiler_svc recommend` of the folder: one per cause, the worst rank's figures
    assert sorted((f["title"], f["saving_us_per_step"]) for f in run["findings"]) == sorted(
        (f["title"], f["saving_us_per_step"]) for f in report["findings"])
    merged = next(f for f in run["findings"] if f["category"] == "communication")
    by_rank = report["findings"][0]["evidence"]["saving_us_per_step_by_rank"]
    assert {str(r["rank"]): r["saving_us_per_step"] for r in merged["ranks"]} == by_rank
    # the cards are the first rank's, as the CLI prints them
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    assert f'id="gpu-busy">{report["trace"]["gpu_busy_pct"]:.1f} %' in page
    assert f'{report["trace"]["kernel_count"]} kernels' in page
    for r in report["ranks"]:
        assert fmt_us(r["step_us"]["median"]) in page
    assert "straggler</strong>" not in page


def test_a_jobs_findings_show_what_each_rank_saves_alone(engine, blobs, client):
    """Ranks NCCL couples: each finding saves the job's step, and its per-rank table gives what each rank saves
    replayed alone (the finding's evidence), as a share of that rank's own step."""
    folder = fixture_dir("llama_nccl_ddp")
    run_id = ingest(engine, blobs, folder)
    report = recommend(str(folder)).to_dict()
    run = client.get(f"/api/v1/runs/{run_id}").get_json()
    assert run["scope"] == "job"
    norm = next(f for f in run["findings"] if f["title"].startswith("eager RMSNorm"))
    by_rank = next(f for f in report["findings"] if f["title"] == norm["title"])["evidence"]["saving_us_per_step_by_rank"]
    assert [(r["rank"], r["saving_us_per_step"]) for r in norm["ranks"]] == [(0, by_rank["0"]), (1, by_rank["1"])]
    assert by_rank["0"] != by_rank["1"]
    # each rank's share of its own step: the rank's replayed step, as the rank's own report gives it
    own = {int(rank): recommend(str(path)).to_dict()["prediction"]["step_us"]
           for rank, path in enumerate(sorted(folder.glob("*.json.gz")))}
    for r in norm["ranks"]:
        assert r["share_of_step_pct"] == pytest.approx(100 * r["saving_us_per_step"] / own[r["rank"]], abs=0.01)
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    table = page[page.index(html.escape(norm["title"], quote=False)):]
    table = table[table.index('<table class="per-rank">'):table.index("</table>", table.index('<table class="per-rank">'))]
    assert "the rank replayed alone" in table
    for rank, saving in by_rank.items():
        assert f"<td>{rank}</td><td class=\"num\">{fmt_us(saving)}</td>" in table


def test_evidence_by_rank_keeps_its_unit(engine, blobs, client):
    """A straggler's per-rank figures ({"0": µs, "1": µs}) are shown in ms or µs, as every other µs value."""
    run_id = ingest(engine, blobs, fixture_dir("llama_nccl_ddp_straggler"))
    straggler = next(f for f in client.get(f"/api/v1/runs/{run_id}").get_json()["findings"]
                     if f["category"] == "communication")
    alone = straggler["evidence"]["step_alone_us_by_rank"]
    page = text_of(client.get(f"/runs/{run_id}").get_data(as_text=True))
    assert f"step alone by rank rank 0 {fmt_us(alone['0'])} rank 1 {fmt_us(alone['1'])}" in page


def test_findings_sharing_a_title_are_not_merged(engine, blobs, client):
    """gpt2_fp16_train has three chain findings titled "chain of memory-bound kernels: 2 chains, 6 kernels"
    (different ops each): one trace's findings are never one cause, whatever their titles."""
    path = fixture_path("gpt2_fp16_train")
    report = recommend(str(path)).to_dict()
    titles = [f["title"] for f in report["findings"]]
    assert max(titles.count(t) for t in titles) >= 3
    run = client.get(f"/api/v1/runs/{ingest(engine, blobs, path)}").get_json()
    assert sorted((f["title"], f["saving_us_per_step"]) for f in run["findings"]) == sorted(
        (f["title"], f["saving_us_per_step"]) for f in report["findings"])
    assert len({f["cause"] for f in run["findings"]}) == len(report["findings"])


@pytest.mark.parametrize("name", ["gpt2_ddp_straggler", "llama_nccl_ddp_straggler"])  # gloo, NCCL
def test_straggler_rank_is_marked(engine, blobs, client, name):
    folder = fixture_dir(name)
    run_id = ingest(engine, blobs, folder)
    report = recommend(str(folder)).to_dict()
    straggler = next(f for f in report["findings"] if f["title"].startswith("rank ") and "straggles" in f["title"])
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    row = re.search(r'<tr class="straggler">(.*?)</tr>', page, re.S).group(1)
    assert f"rank={straggler['rank']}" in row and html.escape(straggler["title"], quote=False) in row
    assert page.count('class="straggler"') == 1


def test_module_view_is_a_tree_of_the_reports_module_times(engine, blobs, client):
    run_id = ingest(engine, blobs, LABELLED)
    modules = recommend(str(LABELLED)).to_dict()["modules"]
    page = client.get(f"/runs/{run_id}/modules").get_data(as_text=True)
    assert "plotly" not in page  # no chart here, no Plotly
    for m in modules:
        assert f'<span class="mod-name">{html.escape(m["name"], quote=False)}</span>' in page
    # the root's subtree is every module's own time
    root_fwd = sum(m["forward_us_per_step"] for m in modules)
    assert f"{fmt_us(root_fwd)} fwd" in page
    # a trace without labels says how to get them
    plain = ingest(engine, blobs, fixture_path("llama_bf16_compiled_infer"))
    assert 'id="no-modules"' in client.get(f"/runs/{plain}/modules").get_data(as_text=True)


def test_a_module_label_hundreds_of_names_deep_renders_under_a_shallow_tree(engine, blobs, client, tmp_path):
    """A label of 300 dotted names (600 characters, a damaged or hostile trace) overflowed the page's recursive macro:
    HTTP 500. Below 24 levels it hangs under its ancestor there, named in full."""
    import gzip
    doc = json.loads(gzip.decompress(LABELLED.read_bytes()))
    deep = ".".join(["m"] * 300)
    for event in doc["traceEvents"]:
        if event.get("name", "").startswith("module::model.layers.0.mlp.down_proj"):
            event["name"] = f"module::{deep} (Linear)"
    path = tmp_path / "deep_module.json"
    path.write_text(json.dumps(doc))
    run_id = ingest(engine, blobs, path)
    response = client.get(f"/runs/{run_id}/modules")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert f'<span class="mod-name">{deep}</span>' in page and page.count('<details class="module"') < 400


def test_top_kernels_show_the_reports_short_names_ops_and_rates(engine, blobs, client):
    run_id = ingest(engine, blobs, LABELLED)
    kernels = recommend(str(LABELLED)).to_dict()["top_kernels"]
    page = client.get(f"/runs/{run_id}/modules").get_data(as_text=True)
    rated = next(k for k in kernels if k["achieved_tflops"] is not None and k["peak_pct"] is not None)
    row = page[page.index(html.escape(rated["short_name"], quote=False)):]
    row = row[:row.index("</tr>")]
    assert f"{rated['achieved_tflops']:.0f} TFLOP/s" in row and f"{rated['peak_pct']:.0f} % FLOP/s" in row
    assert html.escape(rated["top_op"] or rated["op"], quote=False) in row
    # a rate above the copy bandwidth (L2-sized tensors just written) comes with where the bytes came from
    assert ('id="bandwidth-note"' in page) == any((k["bandwidth_pct"] or 0) > 100 for k in kernels)
    plain = ingest(engine, blobs, fixture_path("gpt2_fp16_decode_b1"))  # every rate under it
    assert 'id="bandwidth-note"' not in client.get(f"/runs/{plain}/modules").get_data(as_text=True)
    fast = ingest(engine, blobs, fixture_path("gpt2_hidden1020_fp16_infer"))
    assert "came from L2" in client.get(f"/runs/{fast}/modules").get_data(as_text=True)


def test_timeline_page_links_perfetto_and_explains_gaps(engine, blobs, client):
    run_id = ingest(engine, blobs, LABELLED)
    run = client.get(f"/api/v1/runs/{run_id}").get_json()
    page = client.get(f"/runs/{run_id}/timeline").get_data(as_text=True)
    download = f"http://localhost/api/v1/traces/{run['traces'][0]['id']}/download"
    assert "https://ui.perfetto.dev/#!/?url=" + download.replace(":", "%3A").replace("/", "/") in page.replace("%2F", "/")
    # Perfetto fetches it from its own origin: without this header the browser refused it the file
    assert client.get(download).headers["Access-Control-Allow-Origin"] == "https://ui.perfetto.dev"
    data = json.loads(re.search(r'id="timeline-data">(.*?)</script>', page, re.S).group(1))
    assert data["streams"] and data["causes"]
    gaps = next(f for f in run["findings"] if f["category"] == "launch_gaps")["evidence"]["largest_gaps"]
    assert {c["start_us"] for c in data["causes"]} >= {g["start_us"] for g in gaps}
    assert html.escape(gaps[0]["next_op"], quote=False) in page


def test_ab_form_offers_only_what_applies_and_the_server_checks(engine, blobs, client):
    run_id = ingest(engine, blobs, LABELLED, workload=WORKLOAD)
    run = client.get(f"/api/v1/runs/{run_id}").get_json()
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    form = page[page.index('id="ab"'):]
    offered = re.findall(r'<option value="(\d+)">(\w+) (\w+) ', form[:form.index("</select>")])
    recommended = {(kind, f["recommendation"][kind]) for f in run["findings"] for kind in queries.AB_KINDS
                   if f["recommendation"].get(kind)}
    assert offered and {(kind, name) for _, kind, name in offered} == recommended and len(offered) == len(recommended)
    # the swaps the replay says slow this step (swiglu and rope here) are in the report, not in the form
    report = recommend(str(LABELLED)).to_dict()
    slowing = {f["recommendation"]["swap"] for f in report["findings"] if f["recommendation"]["slows_step"]}
    assert slowing and not slowing & {name for _, kind, name in offered if kind == "swap"}
    assert recommended == {("swap", f["recommendation"]["swap"]) for f in report["findings"]
                           if f["recommendation"]["swap"] and not f["recommendation"]["slows_step"]}
    token = csrf_token(page.encode())
    fix_only = next(f["id"] for f in run["findings"] if f["recommendation"]["fix"] and not f["recommendation"]["swap"])
    for bad in ({"swap": "no_such_swap"}, {"finding_id": "999999"}, {}, {"finding_id": "x"}, {"finding_id": "²"},
                {"finding_id": str(fix_only)}):
        answer = client.post(f"/runs/{run_id}/ab", data={**bad, "csrf_token": token})
        assert answer.status_code in (400, 404) and "Traceback" not in answer.get_data(as_text=True)
    assert client.get("/api/v1/jobs").get_json()["jobs"] == []
    swap_finding, _, swap = next(o for o in offered if o[1] == "swap")
    ok = client.post(f"/runs/{run_id}/ab", data={"finding_id": swap_finding, "csrf_token": token})
    assert ok.status_code == 303
    assert client.get("/api/v1/jobs").get_json()["jobs"][0]["swap"] == swap


def test_static_files_are_compressed_and_cached(engine, blobs, client):
    page = client.get("/", headers={"Accept-Encoding": "gzip"})
    assert page.headers.get("Content-Encoding") == "gzip"
    text = client.get("/").get_data(as_text=True)
    assert "plotly" not in text  # the runs list has no chart
    css = re.search(r'href="(/static/style\.css\?v=\w+)"', text).group(1)
    answer = client.get(css, headers={"Accept-Encoding": "gzip"})
    assert "immutable" in answer.headers["Cache-Control"]
    run_id = ingest(engine, blobs, LABELLED)
    plotly = re.search(r'src="(/static/vendor/plotly[\w.-]*\.js\?v=\w+)"', client.get(f"/runs/{run_id}").get_data(as_text=True))
    chromium = {"Accept-Encoding": "gzip, deflate, br, zstd"}
    js = client.get(plotly.group(1), headers=chromium)
    assert js.headers["Content-Encoding"] in ("zstd", "br") and "immutable" in js.headers["Cache-Control"]
    assert len(js.data) < 500_000  # 1.2 MB raw; the full Plotly bundle was 4.8 MB, 1.4 MB compressed
    again = client.get(plotly.group(1), headers={**chromium, "If-None-Match": js.headers["ETag"]})
    assert again.status_code == 304


def tiled(tmp_path, path, copies: int):
    """A real trace repeated in time (benchmarks/tile_trace.py): `copies` times its steps."""
    import gzip

    # as a package module: benchmarks/ on sys.path would shadow the kernels package with its kernels.py
    from benchmarks.tile_trace import tile
    source = json.loads(gzip.decompress(path.read_bytes()))
    out = tmp_path / f"tiled-{path.name}"
    out.write_bytes(gzip.compress(json.dumps(tile(source, copies * len(source["traceEvents"]))).encode()))
    return out


def test_compare_step_ci_breakdown_and_findings(engine, blobs, client, tmp_path):
    small = fixture_path("llama8_bf16_1x512_train_calibrated")
    large = fixture_path("llama8_bf16_4x1024_train_calibrated")
    # (a tiled copy keeps its capture's run id: a group key of its own keeps it out of the original's run)
    a = ingest(engine, blobs, tiled(tmp_path, small, 3), group_key="tiled-small")
    b = ingest(engine, blobs, tiled(tmp_path, large, 3), group_key="tiled-large")
    cmp = client.get(f"/api/v1/compare?a={a}&b={b}").get_json()
    ra, rb = (client.get(f"/api/v1/runs/{i}").get_json() for i in (a, b))
    sa, sb = ra["analysis"]["steps"]["step_us"], rb["analysis"]["steps"]["step_us"]
    step = cmp["step"]
    shifts = [y - x for x in sa["values"] for y in sb["values"]]  # the Hodges-Lehmann estimate of the shift
    assert step["a_steps"] == len(sa["values"]) >= 3 and step["delta_us"] == pytest.approx(float(np.median(shifts)), abs=0.01)
    assert step["ci_low_us"] <= step["delta_us"] <= step["ci_high_us"]
    # the exact level of the interval for 6 and 6 steps (at least 95%), on the page as the level it is
    assert step["ci_level"] == intervals.shift_rank(6, 6)[1] >= intervals.CI_LEVEL
    page = client.get(f"/compare?a={a}&b={b}").get_data(as_text=True)
    assert fmt_us(step["delta_us"]) in page
    ci = text_of(re.search(r'id="step-ci">(.*?)</div>', page, re.S).group(1)).strip()
    assert ci.startswith(f"{shown_level(step['ci_level'])} CI {fmt_us(step['ci_low_us'])} to {fmt_us(step['ci_high_us'])}")
    assert "no verdict" not in ci
    # every finding of A is resolved, changed or unchanged in B; every finding of B is new, changed or unchanged
    a, b = ingest(engine, blobs, small), ingest(engine, blobs, large)
    cmp = client.get(f"/api/v1/compare?a={a}&b={b}").get_json()
    ra, rb = (client.get(f"/api/v1/runs/{i}").get_json() for i in (a, b))
    fd = cmp["findings"]
    assert len(fd["resolved"]) + len(fd["changed"]) + fd["unchanged"] == len(ra["findings"])
    assert len(fd["new"]) + len(fd["changed"]) + fd["unchanged"] == len(rb["findings"])
    assert fd["changed"] and all(c["delta_us"] == pytest.approx(c["b"]["saving_us_per_step"] - c["a"]["saving_us_per_step"],
                                                                abs=0.02) for c in fd["changed"])
    page = client.get(f"/compare?a={a}&b={b}").get_data(as_text=True)
    assert 'id="compare-form"' in page and f'<option value="{a}" selected>' in page and f'<option value="{b}" selected>' in page
    for f in fd["resolved"] + fd["new"]:
        assert html.escape(f["title"], quote=False) in page
    # two steps a side: the whole range of differences, at the level it has (1 - 2 / C(4, 2)), and no verdict
    step = cmp["step"]
    assert step["a_steps"] == step["b_steps"] == 2 and step["ci_level"] == pytest.approx(2 / 3)
    ci = text_of(re.search(r'id="step-ci">(.*?)</div>', page, re.S).group(1)).strip()
    assert ci == (f"66.7 % CI {fmt_us(step['ci_low_us'])} to {fmt_us(step['ci_high_us'])}: 2 and 2 steps give no "
                  f"{shown_level(intervals.CI_LEVEL)} interval ({intervals.MIN_STEPS} a side do), no verdict")
    for row in cmp["breakdown"]:
        assert fmt_us(row["delta_us"]) in page
    # the same run twice says so, with no chart
    same = client.get(f"/compare?a={a}&b={a}").get_data(as_text=True)
    assert 'id="same-run"' in same and 'id="compare-chart"' not in same and 'id="compare-form"' in same


def test_compare_matches_a_cause_a_labelled_capture_names_by_its_class(engine, blobs, client):
    """The Llama sample (plain torch.profiler) against the same model captured with module labels: "eager RMSNorm"
    was resolved in B and "eager RMSNorm in LlamaRMSNorm" new, one problem listed as gone and as found."""
    a, b = ingest(engine, blobs, fixture_path("llama_bf16_train")), ingest(engine, blobs, LABELLED)
    fd = client.get(f"/api/v1/compare?a={a}&b={b}").get_json()["findings"]
    resolved, new = {f["title"].split(":")[0] for f in fd["resolved"]}, {f["title"].split(":")[0] for f in fd["new"]}
    assert "eager RMSNorm" not in resolved and "eager RMSNorm in LlamaRMSNorm" not in new
    assert "rotary embedding as mul/neg/cat/add kernels" not in resolved  # rope: LlamaAttention's


def test_ab_result_from_a_cpu_is_parity_only(engine, blobs):
    from profiler_svc.storage import save_ab_result
    from tests.storage.test_ab_results import result_dict
    client = make_app(engine, blobs, PUBLIC_READ=True).test_client()
    cpu = save_ab_result(result_dict(device="cpu"), workload=WORKLOAD, engine=engine)
    gpu = save_ab_result(result_dict(), workload=WORKLOAD, engine=engine)
    cpu_page = client.get(f"/jobs/{cpu}").get_data(as_text=True)
    assert 'id="parity-only"' in cpu_page and 'id="verdict">parity passed, timing not measured<' in cpu_page
    assert "×" not in text_of(cpu_page) and "faster" not in text_of(cpu_page) and "plotly" not in cpu_page
    gpu_page = client.get(f"/jobs/{gpu}").get_data(as_text=True)
    assert 'id="verdict">faster<' in gpu_page and 'id="parity-only"' not in gpu_page and "plotly" in gpu_page
    # B's saving, paired by round, where the result has it; a result stored before that field shows none
    paired = result_dict()
    paired["timing"]["saving_ms"] = 1.0
    older = result_dict()
    older["timing"].pop("saving_ms", None)
    pages = {key: client.get(f"/jobs/{save_ab_result(r, workload=WORKLOAD, engine=engine)}")
             for key, r in (("paired", paired), ("older", older))}
    assert all(page.status_code == 200 for page in pages.values())
    assert 'id="ab-saving">1.000 ms<' in pages["paired"].get_data(as_text=True)
    assert 'id="ab-saving"' not in pages["older"].get_data(as_text=True)


def test_ab_job_page_says_where_the_fp64_reference_ran_otherwise(engine, blobs):
    """What the parity was judged against: an op run in a lower precision, parity on part of the batch (the
    fp64 reference out of GPU memory), as the CLI's summary says it; a hostile note is escaped."""
    from profiler_svc.storage import save_ab_result
    from tests.storage.test_ab_results import result_dict
    client = make_app(engine, blobs, PUBLIC_READ=True).test_client()
    noted = result_dict()
    noted["reference_fallbacks"] = [
        {"op": "aten::_grouped_mm", "dtype": "float32"},
        {"op": "inputs", "note": "parity checked on the first 2 of the batch's 4 samples: the float64 reference ran "
                                 "out of GPU memory on more"},
        {"op": "<script>alert(1)</script>", "note": "x"}]
    page = client.get(f"/jobs/{save_ab_result(noted, workload=WORKLOAD, engine=engine)}").get_data(as_text=True)
    assert 'id="reference-notes"' in page
    assert "fp64 reference: aten::_grouped_mm has no float64 kernel here; ran it in float32" in page
    assert "fp64 reference: inputs: parity checked on the first 2 of the batch&#39;s 4 samples" in page
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    plain = result_dict()
    plain["reference_fallbacks"] = []
    page = client.get(f"/jobs/{save_ab_result(plain, workload=WORKLOAD, engine=engine)}").get_data(as_text=True)
    assert 'id="reference-notes"' not in page


def test_the_idle_table_names_the_users_own_code(engine, blobs, client):
    """Rank 0 of the hostsync capture sleeps 10 ms a step with no op on any thread: the run page's idle table has
    that cause on a row of its own, with the analyser's figure per step."""
    trace = fixture_dir("llama_nccl_ddp_hostsync_4step") / "llama_nccl_ddp_hostsync_4step_rank0.json.gz"
    run_id = ingest(engine, blobs, trace)
    own = recommend(str(trace)).to_dict()["steps"]["idle"]["own_code"]
    assert own["gaps"] == 4
    page = text_of(client.get(f"/runs/{run_id}").get_data(as_text=True))
    assert f"the host in your own code (no op on any thread: a sleep, data prep) {fmt_us(own['idle_us_per_step'])} 4" in page
