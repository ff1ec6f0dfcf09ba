"""Headless Chromium (Debian's, driven by Playwright) opens the dashboard, sees the charts drawn,
and clicks run -> finding -> A/B request. Skipped when chromium or playwright is absent."""
import os
import shutil
import threading

import pytest

from tests.plugins.database import trace_variant
from tests.plugins.traces import fixture_path
from profiler_svc.storage import db as storage_db
from profiler_svc.storage.blobs import BlobStore
from profiler_svc.storage.ingest import ingest_path
from profiler_svc.web import create_app

CHROMIUM = os.environ.get("PROFILER_SVC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed")
HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"
TOKEN = "browser-token"


def sign_in(page, base):
    """The dashboard asks for a token first; the sign-in form leads back to the page asked for."""
    page.goto(base + "/")
    page.wait_for_selector("input[name=token]")
    assert "/signin" in page.url
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


@pytest.fixture
def server(tmp_path):
    url = f"sqlite:///{tmp_path / 'browser.sqlite3'}"
    engine = storage_db.get_engine(url)
    storage_db.upgrade(engine)
    blobs = BlobStore(tmp_path / "blobs")
    [run] = ingest_path(engine, fixture_path("llama_bf16_train"), blobs=blobs, name="llama train",
                        workload="profiler_svc.service.demo:tiny_llama")
    [hostile] = ingest_path(engine, trace_variant(tmp_path, "hostile", kernel_name=HOSTILE), blobs=blobs,
                            name=HOSTILE)
    app = create_app({"DATABASE_URL": url, "BLOB_DIR": str(blobs.root), "SECRET_KEY": "browser-test",
                      "API_TOKEN": TOKEN})
    from werkzeug.serving import make_server
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.port}", run.run_id, hostile.run_id
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
        page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
        yield page
        browser.close()


def test_run_charts_finding_and_ab_request(server, page):
    base, run_id, _ = server
    sign_in(page, base)
    page.click("text=llama train")
    page.wait_for_url(f"**/runs/{run_id}")
    # Plotly drew both charts: bars for the top kernels, one line per stream plus the idle row.
    page.wait_for_selector("#top-kernels-chart .main-svg")
    page.wait_for_selector("#timeline-chart .main-svg")
    assert page.locator("#top-kernels-chart .bars path").count() >= 5
    assert page.locator("#timeline-chart .scatterlayer .trace").count() >= 2
    assert page.locator(".kernels tbody tr").count() >= 5

    # Zoom the timeline (drag a box): the x range narrows.
    drag = page.locator("#timeline-chart .nsewdrag").first
    drag.scroll_into_view_if_needed()
    box = drag.bounding_box()
    before = page.evaluate("document.getElementById('timeline-chart').layout.xaxis.range.slice()")
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + 10)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 10, steps=5)
    page.mouse.up()
    page.wait_for_timeout(200)
    after = page.evaluate("document.getElementById('timeline-chart').layout.xaxis.range.slice()")
    assert after[1] - after[0] < (before[1] - before[0]) * 0.5

    finding = page.locator("details.finding", has=page.locator(".ab-button")).first
    swap = finding.locator("code.swap").text_content() if finding.count() else None
    assert swap, "the llama training trace should have a finding with a bundled swap"
    finding.locator("summary").first.click()
    finding.locator(".ab-button").click()
    page.wait_for_url("**/jobs/*")
    assert page.locator("#job-status").inner_text() == "queued"
    assert swap in page.content()
    assert page.errors == [] and page.dialogs == []


def test_hostile_names_do_not_run_in_the_browser(server, page):
    base, _, hostile_run = server
    sign_in(page, base)
    page.goto(f"{base}/runs/{hostile_run}")
    page.wait_for_selector("#top-kernels-chart .main-svg")
    # Hover the hostile kernel's bar (the only one with a count of 1 and the first kernel's time):
    # Plotly shows its name as text in the tooltip.
    bars = page.locator("#top-kernels-chart .bars path")
    shown = []
    for i in range(bars.count()):
        box = bars.nth(i).bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_timeout(50)
        shown.append(page.locator("#top-kernels-chart .hovertext").all_text_contents())
    assert any("<script>alert(2)</script>" in " ".join(texts) for texts in shown)
    assert HOSTILE in page.locator("h1").inner_text()
    assert page.dialogs == [] and page.errors == []
