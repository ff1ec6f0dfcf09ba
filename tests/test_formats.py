"""The bottom-level homes of shared formats: profiler_svc.formats and profiler_svc.workload_spec."""
import json

import numpy as np
import pytest

from profiler_svc.errors import UserError
from profiler_svc.formats import fmt_us, one_line, plain_json
from profiler_svc.workload_spec import check_workload_spec, split_workload_spec


@pytest.mark.parametrize("value, text", [
    (None, "–"), (0, "0.0 µs"), (999.94, "999.9 µs"), (1000, "1.00 ms"), (12_345.6, "12.35 ms"),
    (4_560_000, "4.56 s"), (-1500, "-1.50 ms"), (np.float32(2500), "2.50 ms"), ("750", "750.0 µs"),
])
def test_fmt_us(value, text):
    assert fmt_us(value) == text


def test_one_line_keeps_the_type_and_the_first_line():
    assert one_line(ValueError("bad shape\n  at line 3")) == "ValueError: bad shape"
    assert one_line(KeyError()) == "KeyError: "


def test_plain_json_is_strict_json():
    value = {1: np.float64("nan"), "a": (np.int64(3), np.float32(0.5), float("inf")), "b": np.array([[1.5, np.nan]]),
             "c": np.bool_(True), "d": object.__new__(type("Thing", (), {"__str__": lambda self: "thing"})),
             "e": [None, "s", True, 7]}
    plain = plain_json(value)
    assert plain == {"1": None, "a": [3, 0.5, None], "b": [[1.5, None]], "c": True, "d": "thing",
                     "e": [None, "s", True, 7]}
    assert type(plain["a"][0]) is int and type(plain["c"]) is bool
    json.dumps(plain, allow_nan=False)  # raises on anything JSON cannot hold


def test_workload_spec():
    assert check_workload_spec("pkg.module:factory") == "pkg.module:factory"
    assert split_workload_spec("pkg.sub.module:make_model") == ("pkg.sub.module", "make_model")


@pytest.mark.parametrize("spec", ["pkg.module", "pkg:a.b", ":f", "pkg:", "a b:c", "pkg:f\n", "1pkg:f", 3, None])
def test_bad_workload_specs_are_one_line_errors(spec):
    with pytest.raises(UserError, match="^workload must look like 'pkg.module:factory', got ") as err:
        check_workload_spec(spec)
    assert "\n" not in str(err.value)
