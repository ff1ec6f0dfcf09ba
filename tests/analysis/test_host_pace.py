"""A swap's measured host cost is paced to the capturing host: capture times a fixed piece of eager host work
(agent/host_probe.py) and the host-cost table holds the same probe timed beside its figures, so a host twice as
slow as the measuring one is priced at twice the µs per call. Real trace: HF Llama, 8 layers, bf16 training at
1x512 tokens on an H100, host-bound (tests/data/agent), its capture metadata given a probe."""
import gzip
import json
import math

import pytest

from profiler_svc import load_trace
from profiler_svc.agent.host_probe import host_probe_us
from profiler_svc.detectors.swap_costs import HOST_PACE_BOUNDS, COSTS_FILE, _kernels_dir, host_costs_from, swap_host_cost
from profiler_svc.recommendations import recommend
from tests.plugins.traces import fixture_path

LLAMA_HOST_BOUND = "llama8_bf16_1x512_train_calibrated"
TABLE_PROBE_US = 40.0


def _trace_with_probe(tmp_path, probe):
    data = json.loads(gzip.open(fixture_path(LLAMA_HOST_BOUND)).read())
    data["profiler_svc"]["unprofiled"]["host_probe_us"] = probe
    path = tmp_path / f"llama_probe_{abs(hash(repr(probe)))}.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return path


@pytest.fixture
def probed_table(tmp_path):
    """The package's host-cost table with every entry's probe at TABLE_PROBE_US."""
    table = json.loads((_kernels_dir() / COSTS_FILE).read_text())
    for entry in table["swaps"].values():
        entry["host_probe_us"] = TABLE_PROBE_US
    path = tmp_path / "host_costs.json"
    path.write_text(json.dumps(table))
    return path


def test_a_swaps_host_cost_follows_the_capturing_hosts_pace(tmp_path, probed_table):
    findings = {}
    with host_costs_from(probed_table):
        for probe in (None, TABLE_PROBE_US, TABLE_PROBE_US / 2, TABLE_PROBE_US * 2):
            report = recommend(str(_trace_with_probe(tmp_path, probe)))
            findings[probe] = next(f for f in report.findings if f.category == "unfused_chain"
                                   and f.evidence["pattern"] == "rms_norm")
        base = swap_host_cost("rms_norm", True)
        assert swap_host_cost("rms_norm", True, host_probe_us=TABLE_PROBE_US * 2) == pytest.approx(2 * base)
        assert swap_host_cost("rms_norm", True, host_probe_us=TABLE_PROBE_US * 100) == pytest.approx(
            HOST_PACE_BOUNDS[1] * base)  # a probe gone wrong is bounded
    saving = {probe: f.saving_us_per_step for probe, f in findings.items()}
    # the swap's calls cost the host less than eager's: a slower host saves more per call, a faster one less
    assert saving[None] == saving[TABLE_PROBE_US]
    assert saving[TABLE_PROBE_US / 2] < saving[TABLE_PROBE_US] < saving[TABLE_PROBE_US * 2]
    assert "taken at 2.00x" in findings[TABLE_PROBE_US * 2].detail
    assert "taken at 0.50x" in findings[TABLE_PROBE_US / 2].detail
    assert "x: this host's pace" not in findings[TABLE_PROBE_US].detail


def test_a_table_without_a_probe_keeps_its_figures(tmp_path):
    """Entries measured before the probe (no host_probe_us) are not paced, whatever the trace's probe."""
    table = json.loads((_kernels_dir() / COSTS_FILE).read_text())
    for entry in table["swaps"].values():
        entry.pop("host_probe_us", None)
    path = tmp_path / "host_costs.json"
    path.write_text(json.dumps(table))
    with host_costs_from(path):
        assert swap_host_cost("rope", False, host_probe_us=500.0) == swap_host_cost("rope", False)


@pytest.mark.parametrize("junk", [True, "12", -3.0, 0, 10 ** 400, [1.0], {"us": 1.0}])
def test_a_junk_probe_in_the_metadata_is_no_probe(tmp_path, junk):
    trace = load_trace(str(_trace_with_probe(tmp_path, junk)))
    assert trace.host_probe_us is None


def test_the_probe_times_the_host_on_the_cpu():
    us = host_probe_us("cpu")
    assert math.isfinite(us) and 0 < us < 1e5
