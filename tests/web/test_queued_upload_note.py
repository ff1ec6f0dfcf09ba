"""An upload of content already queued (its analysis not done yet) gets the queued upload's job back (202): its
answer says when the name, run key or workload it asked for differ from the queued upload's, which are the ones
applied, as the answer for content stored already (200) says it of the stored run's."""
import pytest

from tests.plugins.traces import SMALL_TRACE
from tests.web.uploads import analyse_queued, post_trace
from profiler_svc.web import create_app

AUTH = {"Authorization": "Bearer note-token"}


@pytest.fixture
def client(engine, blobs):
    return create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "BLOB_DIR": str(blobs.root),
                       "API_TOKEN": "note-token", "SECRET_KEY": "s", "TESTING": True}).test_client()


def test_a_second_upload_of_queued_content_says_its_name_and_run_key_were_not_applied(client):
    first = post_trace(client, SMALL_TRACE, AUTH, name="first", run="job-1")
    assert first.status_code == 202 and first.get_json()["note"] is None
    upload_id = first.get_json()["upload_id"]

    second = post_trace(client, SMALL_TRACE, AUTH, name="second", run="job-2", workload="pkg.mod:make")
    assert second.status_code == 202
    body = second.get_json()
    assert body["upload_id"] == upload_id and body["status"] == "queued" and not body["duplicate"]
    assert body["note"] == (f"already queued as upload {upload_id} with run key 'job-1', name 'first', no workload; "
                            "run key 'job-2', name 'second', workload 'pkg.mod:make' were not applied")
    # the same request, or none: nothing to say
    assert post_trace(client, SMALL_TRACE, AUTH, name="first", run="job-1").get_json()["note"] is None
    assert post_trace(client, SMALL_TRACE, AUTH).get_json()["note"] is None
    assert post_trace(client, SMALL_TRACE, AUTH, name="other").get_json()["note"] == (
        f"already queued as upload {upload_id} with name 'first'; name 'other' was not applied")

    assert analyse_queued(client.application) == 1
    done = client.get(f"/api/v1/uploads/{upload_id}", headers=AUTH).get_json()
    run = client.get(f"/api/v1/runs/{done['run_id']}", headers=AUTH).get_json()
    assert (run["name"], run["group_key"], run["workload"]) == ("first", "job-1", None)
