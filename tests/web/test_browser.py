"""Headless Chromium (Debian's, driven by Playwright) opens every view of the dashboard: the answer-first run
page, the module view, the timeline, the ranks of a multi-rank job, compare, the A/B flow, and a trace whose
kernel names are an XSS payload. Skipped when chromium or playwright is absent."""
import os
import shutil
import threading

import pytest

from tests.plugins.database import trace_variant
from tests.plugins.traces import fixture_dir, fixture_path
from profiler_svc.storage import db as storage_db
from profiler_svc.storage.blobs import BlobStore
from profiler_svc.storage.ingest import ingest_path
from profiler_svc.web import create_app

CHROMIUM = os.environ.get("PROFILER_SVC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed")
HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"
LABELLED = fixture_path("llama_bf16_train_agent")  # module labels, swaps to A/B
TOKEN = "browser-token"


def sign_in(page, base):
    """The dashboard asks for a token first; the sign-in form leads back to the page asked for."""
    page.goto(base + "/")
    page.wait_for_selector("input[name=token]")
    assert "/signin" in page.url
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # one server for the module: the per-test settings, once
        env.setenv("PROFILER_SVC_HOME", str(tmp_path_factory.mktemp("home")))
        env.setenv("PROFILER_SVC_ALLOWED_WORKLOADS", "profiler_svc.service.demo")
        yield from _server(tmp_path_factory.mktemp("browser"))


def _server(tmp_path):
    url = f"sqlite:///{tmp_path / 'browser.sqlite3'}"
    engine = storage_db.get_engine(url)
    storage_db.upgrade(engine)
    blobs = BlobStore(tmp_path / "blobs")
    runs = {
        "llama": ingest_path(engine, LABELLED, blobs=blobs, name="llama train",
                             workload="profiler_svc.service.demo:tiny_llama")[0].run_id,
        "hostile": ingest_path(engine, trace_variant(tmp_path, "hostile", kernel_name=HOSTILE, source=LABELLED),
                               blobs=blobs, name=HOSTILE, group_key="hostile")[0].run_id,
        "straggler": ingest_path(engine, fixture_dir("gpt2_ddp_straggler"), blobs=blobs)[0].run_id,
    }
    app = create_app({"DATABASE_URL": url, "BLOB_DIR": str(blobs.root), "SECRET_KEY": "browser-test",
                      "API_TOKEN": TOKEN})
    from werkzeug.serving import make_server
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.port}", runs
    httpd.shutdown()
    storage_db._engines.pop(url).dispose()


@pytest.fixture
def page():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.errors, page.dialogs = [], []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
        page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
        yield page
        browser.close()


def test_run_page_answers_first_then_ab_request(server, page):
    base, runs = server
    sign_in(page, base)
    # the runs list names each run's top finding and what it saves
    row = page.locator("tr", has=page.locator("a.run-link", has_text="llama train"))
    assert row.locator("td.num").nth(2).inner_text().endswith(("ms", "µs"))  # span, GPU busy, saving
    assert row.locator(".top-finding a").inner_text().startswith("GPU idle")
    row.locator("a.run-link").click()
    page.wait_for_url(f"**/runs/{runs['llama']}")
    # the answer fits the first screen: the step, the step after all fixes, the waterfall, the first finding
    page.wait_for_selector("#waterfall-chart .main-svg")
    assert_waterfall(page)
    assert page.locator("#predicted-step").bounding_box()["y"] < 400
    first = page.locator("details.finding").first
    assert first.get_attribute("open") is not None
    assert first.bounding_box()["y"] < 1000 + 400  # below the waterfall, not 1540 px down
    # evidence is a table, not JSON
    evidence = first.locator(".evidence-table")
    assert evidence.locator("th").count() >= 3 and "{" not in evidence.inner_text()
    # the breakdown, below the first screen, is drawn when it scrolls near (app.js drawWhenNear), not at load
    breakdown = page.locator("#breakdown-chart")
    if breakdown.bounding_box()["y"] > 1000 + 200:
        assert breakdown.locator(".main-svg").count() == 0
    breakdown.scroll_into_view_if_needed()
    page.wait_for_selector("#breakdown-chart .main-svg")

    # the A/B form offers only what the findings recommend
    options = page.locator("#ab select option")
    assert options.count() >= 1 and all(t.split()[0] in ("swap", "fix") for t in options.all_inner_texts())
    swap_option = page.locator("#ab select option", has_text="swap ").first
    page.select_option("#ab select", value=swap_option.get_attribute("value"))
    swap = swap_option.inner_text().split()[1]
    page.click("#ab button[type=submit]")
    page.wait_for_url("**/jobs/*")
    assert page.locator("#job-status").inner_text() == "queued"
    assert swap in page.content()
    assert page.errors == [] and page.dialogs == []


def assert_waterfall(page):
    """The waterfall (floating bars: the vendored Plotly has no waterfall trace): the step now, one bar per fix
    from where the bar before it ended to the step after that fix, and the step after all fixes."""
    fixes = page.evaluate("JSON.parse(document.getElementById('waterfall-data').textContent).waterfall")
    bars = page.evaluate("[...document.querySelectorAll('#waterfall-chart .bars .point path')]"
                         ".map(p => { const b = p.getBBox(); return {x: b.x, y: b.y, right: b.x + b.width}; })")
    assert len(bars) == len(fixes) + 2 and len(fixes) >= 2 and all(f["saving_us_per_step"] > 0 for f in fixes)
    assert [b["y"] for b in bars] == sorted(b["y"] for b in bars)  # top to bottom
    ends = [bars[0]["right"]] + [b["x"] for b in bars[1:-1]]  # the step after each bar, in px
    for before, bar in zip(ends, bars[1:-1]):
        assert bar["right"] == pytest.approx(before, abs=1)
    assert bars[-1]["x"] == bars[0]["x"] and bars[-1]["right"] == pytest.approx(ends[-1], abs=1)
    px_per_us = (bars[0]["right"] - bars[0]["x"]) / page.evaluate(
        "JSON.parse(document.getElementById('waterfall-data').textContent).step_us")
    assert [(b["right"] - b["x"]) / px_per_us for b in bars[1:-1]] == pytest.approx(
        [f["saving_us_per_step"] for f in fixes], abs=1.5 / px_per_us)
    labels = page.evaluate("[...document.querySelectorAll('#waterfall-chart .bars .point text')].map(t => t.textContent)")
    assert len(labels) == len(bars) and all(t.startswith("−") for t in labels[1:-1])  # what each fix saves
    # each bar is numbered as its finding in the list below (the replay's order was numbered 1..n on its own)
    ticks = page.evaluate("[...document.querySelectorAll('#waterfall-chart .ytick text')].map(t => t.textContent)")
    titles = page.evaluate("[...document.querySelectorAll('#findings details.finding .title')].map(t => t.textContent)")
    for fix, tick in zip(fixes, ticks[1:-1]):
        number = int(tick.split(".", 1)[0])
        assert titles[number - 1].startswith(tick.split(". ", 1)[1].rstrip("…"))


def test_module_view_tree_opens_and_closes(server, page):
    base, runs = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{runs['llama']}")
    page.click("nav.tabs >> text=Modules & kernels")
    page.wait_for_url(f"**/runs/{runs['llama']}/modules")
    assert page.locator("script[src*=plotly]").count() == 0
    # two levels open at first; model.layers (the third) opens on a click and shows its layers
    layers = page.locator("details.module:has(> summary > .mod-name:text-is('model.layers'))")
    child = layers.locator("> details.module").first
    assert layers.count() == 1 and layers.is_visible() and not child.is_visible()
    layers.locator("> summary").click()
    assert child.is_visible() and child.locator("> summary .mod-name").inner_text().startswith("model.layers.")
    layers.locator("> summary").click()
    assert not child.is_visible()
    assert page.locator("table.kernels tbody tr").count() >= 10
    assert page.locator("table.kernels", has_text="TFLOP/s").count() == 1
    assert page.errors == []


def test_timeline_zooms_and_links_perfetto(server, page):
    base, runs = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{runs['llama']}/timeline")
    page.wait_for_selector("#timeline-chart .main-svg")
    assert page.locator("#timeline-chart .scatterlayer .trace").count() >= 3
    lanes = page.evaluate("document.getElementById('timeline-chart').data.map(t => t.name)")
    assert lanes[0] == "CPU launches" and lanes[-1] == "GPU idle" and any(n.startswith("dev ") for n in lanes)
    # one SVG path per lane however many segments (a path per segment took half the page's time on a big trace)
    assert page.locator("#timeline-chart .scatterlayer .js-fill").count() == len(lanes)
    assert page.locator("#timeline-chart .scatterlayer .js-line").count() == 0
    drag = page.locator("#timeline-chart .nsewdrag").first
    box = drag.bounding_box()
    before = page.evaluate("document.getElementById('timeline-chart').layout.xaxis.range.slice()")
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + 10)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 10, steps=5)
    page.mouse.up()
    page.wait_for_timeout(200)
    after = page.evaluate("document.getElementById('timeline-chart').layout.xaxis.range.slice()")
    assert after[1] - after[0] < (before[1] - before[0]) * 0.5
    # idle bars carry the analyser's cause (the hover text of the "GPU idle" row)
    texts = page.evaluate("document.getElementById('timeline-chart').data.find(t => t.name === 'GPU idle').text")
    assert any(t and "cause: host wait" in t for t in texts)
    href = page.locator("a.perfetto").first.get_attribute("href")
    assert href.startswith("https://ui.perfetto.dev/#!/?url=") and "download" in href
    assert page.locator("table.gaps tbody tr").count() >= 1
    assert page.errors == []


def test_timeline_joins_subpixel_gaps_and_keeps_busy_time(server, page):
    """Kernel and launch lanes are drawn with the segments less than a pixel apart joined (Plotly's time grows with
    the segments); the joined lanes cover every stored segment and add up to the same kernels and busy time, and
    zooming in joins them again at the new scale, so the gaps come back."""
    base, runs = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{runs['llama']}/timeline")
    page.wait_for_selector("#timeline-chart .main-svg")
    lanes = page.evaluate("""() => {
      const t = JSON.parse(document.getElementById('timeline-data').textContent);
      return [t.launches].concat(t.streams).map(lane => {
        const joined = mergeSegments(lane, 1000);  // 1 ms
        return {lane, joined, again: mergeSegments(joined, 1000)};
      });
    }""")
    joined_any = False
    for item in lanes:
        lane, joined = item["lane"], item["joined"]
        assert sum(joined["count"]) == sum(lane["count"])
        assert sum(joined["busy_us"]) == pytest.approx(sum(lane["busy_us"]))
        assert all(b - a >= 1000 for a, b in zip(joined["end"], joined["start"][1:]))
        for s, e in zip(lane["start"], lane["end"]):  # every stored segment inside one joined segment
            assert any(js <= s and e <= je for js, je in zip(joined["start"], joined["end"]))
        assert item["again"] == joined  # joining is idempotent
        joined_any |= len(joined["start"]) < len(lane["start"])
    assert joined_any
    # on screen: fewer corners than stored segments at first, more after zooming in
    drawn = "document.getElementById('timeline-chart').data.filter(t => t.name !== 'GPU idle')" \
            ".reduce((n, t) => n + t.x.filter(v => v !== null).length / 4, 0)"
    stored = sum(len(item["lane"]["start"]) for item in lanes)
    at_first = page.evaluate(drawn)
    assert at_first < stored
    idle = page.evaluate("document.getElementById('timeline-chart').data.find(t => t.name === 'GPU idle').x.length")
    assert idle == 5 * len(page.evaluate("JSON.parse(document.getElementById('timeline-data').textContent).gaps.start"))
    page.evaluate("""() => { const el = document.getElementById('timeline-chart'), [a, b] = el.layout.xaxis.range;
                            return Plotly.relayout(el, {'xaxis.range': [a, a + (b - a) / 50]}); }""")
    assert page.evaluate(drawn) > at_first
    page.evaluate("Plotly.relayout(document.getElementById('timeline-chart'), {'xaxis.autorange': true})")
    assert page.evaluate(drawn) <= at_first + 2
    assert page.errors == []


def test_ranks_one_finding_per_cause_and_the_straggler(server, page):
    base, runs = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{runs['straggler']}")
    page.wait_for_selector("#waterfall-chart .main-svg")
    ranks = page.locator("table.ranks tbody tr")
    assert ranks.count() == 2
    straggler = page.locator("table.ranks tr.straggler")
    assert straggler.count() == 1 and straggler.locator("td").first.inner_text() == "1"
    titles = page.locator("details.finding .title").all_inner_texts()
    assert len(titles) == len(set(titles))  # not once per rank
    gloo = page.locator("details.finding", has_text="waiting on gloo").first
    assert gloo.locator("table.per-rank tbody tr").count() == 2
    assert page.errors == []


def test_hostile_names_render_as_text(server, page):
    base, runs = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{runs['hostile']}")
    page.wait_for_selector("#waterfall-chart .main-svg")
    assert HOSTILE in page.locator("h1").inner_text()
    page.goto(f"{base}/runs/{runs['hostile']}/modules")
    cell = page.locator("table.kernels td.kernel-name").first  # the renamed kernel is the longest
    assert cell.get_attribute("title") == HOSTILE and cell.inner_text().startswith("<img src=x")
    assert cell.locator("img, script").count() == 0
    page.goto(f"{base}/compare?a={runs['llama']}&b={runs['hostile']}")
    page.wait_for_selector("#compare-form")
    # two steps a side: the interval at the level it has (1 - 2 / C(4, 2)), which is no verdict
    ci = page.locator("#step-ci").inner_text()
    assert ci.startswith("66.7 % CI ") and ci.endswith("2 and 2 steps give no 95 % interval (4 a side do), no verdict")
    page.goto(f"{base}/runs/{runs['hostile']}/timeline")
    page.wait_for_selector("#timeline-chart .main-svg")
    assert page.evaluate("document.querySelectorAll('img[src=x], script:not([src]):not([type])').length") == 0
    assert page.dialogs == [] and page.errors == []
