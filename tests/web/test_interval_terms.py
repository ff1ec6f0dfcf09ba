"""The A/B job page states the level a verdict needs and the rounds that reach it from their one torch-free home
(profiler_svc.intervals), not as numbers of its own; the web reads them without loading torch."""
import json
import re
import subprocess
import sys

from profiler_svc.storage import save_ab_result
from profiler_svc import intervals
from tests.storage.test_ab_results import result_dict
from tests.web.test_pages import WORKLOAD, shown_level, text_of
from tests.web.test_web import make_app


def few_rounds(rounds: int, level: float) -> dict:
    result = result_dict(verdict="no_difference")
    result["timing"].update(rounds=rounds, a_ms=[2.0] * rounds, b_ms=[1.0] * rounds, ci_level=level)
    return result


def speedup_note(client, job_id: int) -> tuple[str, str | None]:
    """The job page's speedup interval, and its note on too few rounds (None where it has none)."""
    page = client.get(f"/jobs/{job_id}").get_data(as_text=True)
    ci = re.search(r'<div class="label"[^>]*>([^<]* % CI [^<]*)</div>', page)
    note = re.search(r'id="few-rounds">(.*?)</div>', page, re.S)
    assert ci is not None
    return text_of(ci.group(1)).strip(), note and text_of(note.group(1)).strip()


def test_the_job_page_follows_the_level_and_the_fewest_rounds(engine, blobs, monkeypatch):
    client = make_app(engine, blobs, PUBLIC_READ=True).test_client()
    three = save_ab_result(few_rounds(3, 1 - 2 / 2 ** 3), workload=WORKLOAD, engine=engine)
    assert speedup_note(client, three) == ("75 % CI 1.700–2.200", f"3 rounds give no {shown_level(intervals.CI_LEVEL)} "
                                           f"interval ({intervals.MIN_ROUNDS} do): no verdict on speed")
    assert speedup_note(client, three)[1] == "3 rounds give no 95 % interval (6 do): no verdict on speed"
    seven = save_ab_result(few_rounds(7, 0.95), workload=WORKLOAD, engine=engine)
    assert speedup_note(client, seven) == ("95 % CI 1.700–2.200", None)
    # a stricter level needs more rounds: the page says what the constants say
    monkeypatch.setattr(intervals, "CI_LEVEL", 0.99)
    monkeypatch.setattr(intervals, "MIN_ROUNDS", 8)
    assert speedup_note(client, seven) == ("95 % CI 1.700–2.200",
                                           "7 rounds give no 99 % interval (8 do): no verdict on speed")


def test_the_web_renders_the_job_page_without_torch(tmp_path):
    """The dashboard's process never loads torch, also where it states the A/B's level and rounds."""
    (tmp_path / "result.json").write_text(json.dumps(result_dict()))  # made here: ABResult's module loads torch
    code = f"""
import json, sys
from profiler_svc.storage import db, save_ab_result
from profiler_svc.web import create_app
url = "sqlite:///{tmp_path / 'web.sqlite3'}"
db.upgrade(db.get_engine(url))
result = json.loads(open("{tmp_path / 'result.json'}").read())
job = save_ab_result(result, workload="m:f", engine=db.get_engine(url))
app = create_app({{"DATABASE_URL": url, "BLOB_DIR": "{tmp_path / 'blobs'}", "SECRET_KEY": "x", "PUBLIC_READ": True}})
page = app.test_client().get(f"/jobs/{{job}}").get_data(as_text=True)
print(" % CI " in page, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "False"], out.stderr[-2000:]
