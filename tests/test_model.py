"""Action model: demand validation, elasticity, durations and history estimates."""

from __future__ import annotations

import math

import pytest

from tangram.model import (
    Choices,
    Elasticity,
    HistoryEstimator,
    InvalidDemand,
    Range,
    Unschedulable,
    make_action,
    parse_amounts,
)

BAD = [
    # name, kind, demand, extra kwargs, field named in the error
    ("min_gt_max", "exec", {"cpu": [4, 2]}, {}, "demand.cpu"),
    ("empty_set", "service", {"gpu": {"set": []}}, {"service": "j"}, "demand.gpu"),
    ("negative", "exec", {"cpu": -1}, {}, "demand.cpu"),
    ("nan", "exec", {"cpu": math.nan}, {}, "demand.cpu"),
    ("fraction", "exec", {"cpu": 1.5}, {}, "demand.cpu"),
    ("absurd", "exec", {"cpu": 10**7}, {}, "demand.cpu"),
    ("bool", "exec", {"cpu": True}, {}, "demand.cpu"),
    ("unknown_resource", "exec", {"cpu": 1, "tpu": 1}, {}, "demand"),
    ("unknown_kind", "teleport", {"cpu": 1}, {}, "kind"),
    ("zero_key", "exec", {"cpu": 0}, {}, "demand.cpu"),
    ("exec_not_cpu", "exec", {"cpu": 1, "gpu": 1}, {"key": "gpu"}, "key"),
    ("service_without_name", "service", {"gpu": 1}, {}, "service"),
    ("eff_out_of_range", "exec", {"cpu": [1, 2]}, {"t1_s": 1.0, "eff": {1: 1, 2: 1.5}}, "eff.2"),
    ("t1_negative", "exec", {"cpu": [1, 2]}, {"t1_s": -1.0, "eff": {1: 1}}, "t1_s"),
    ("dur_nan", "exec", {"cpu": 1}, {"dur_s": math.nan}, "dur_s"),
]


@pytest.mark.parametrize(("name", "kind", "demand", "kw", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_demands_are_rejected_naming_the_field(name, kind, demand, kw, field):
    """Each invalid demand raises InvalidDemand whose message starts with the field name."""
    with pytest.raises(InvalidDemand) as err:
        make_action("a", kind, "t", demand, **kw)
    assert err.value.field == field, name
    assert str(err.value).startswith(field)
    assert err.value.code == "bad_request"


def test_allowed_values_are_named():
    """Errors for enumerations and ranges list what is allowed."""
    with pytest.raises(InvalidDemand, match=r"allowed: exec, service, api"):
        make_action("a", "bogus", "t", {"cpu": 1})
    with pytest.raises(InvalidDemand, match=r"allowed: .*api:<name>"):
        make_action("a", "exec", "t", {"disk": 1})


def test_more_than_the_cluster_is_unschedulable():
    """A demand above the largest node's capacity is rejected at submission."""
    with pytest.raises(Unschedulable, match=r"demand\.cpu"):
        make_action("a", "exec", "t", {"cpu": 300}, capacity={"cpu": 256})


def test_amount_forms():
    """n, [min, max], {'set': [...]} and {'min','max'} parse to Range/Choices."""
    assert parse_amounts("cpu", 3) == Range(3, 3)
    assert parse_amounts("cpu", [1, 8]) == Range(1, 8)
    assert parse_amounts("gpu", {"set": [8, 1, 2, 4, 2]}) == Choices((1, 2, 4, 8))
    assert parse_amounts("gpu", [1, 2, 4]) == Choices((1, 2, 4))
    assert parse_amounts("cpu", {"min": 2, "max": 4}) == Range(2, 4)


def test_elasticity_formula_and_interpolation():
    """dur(m) = T1 / (E(m) * m) with E linearly interpolated between profiled points."""
    e = Elasticity.of(120.0, {"1": 1.0, "2": 0.9, "8": 0.6})
    assert e.dur(1) == pytest.approx(120.0)
    assert e.dur(2) == pytest.approx(120.0 / 1.8)
    assert e.efficiency(4) == pytest.approx(0.9 + (4 - 2) / 6 * (0.6 - 0.9))
    assert e.dur(8) == pytest.approx(120.0 / 4.8)
    with pytest.raises(InvalidDemand):
        e.efficiency(16)


def test_elastic_action_allowed_amounts_follow_profile():
    """Allowed key amounts are the demand's intersected with the profiled range."""
    a = make_action("a", "exec", "t", {"cpu": [1, 32]}, t1_s=60, eff={1: 1, 8: 0.7})
    assert a.allowed_units() == tuple(range(1, 9)) and a.is_elastic()
    assert a.duration(8, fallback=0.0) == pytest.approx(60 / (0.7 * 8))
    plain = make_action("b", "exec", "t", {"cpu": [1, 32]})
    assert plain.allowed_units() == (1,) and not plain.is_elastic()  # unknown E: minimum


def test_history_estimator_running_mean():
    """Unprofiled actions use the running mean of their class, else the default."""
    h = HistoryEstimator(default_s=2.0)
    assert h.estimate("t/exec/ls") == 2.0
    for x in (1.0, 2.0, 6.0):
        h.observe("t/exec/ls", x)
    h.observe("t/exec/ls", math.nan)  # ignored
    assert h.estimate("t/exec/ls") == pytest.approx(3.0)
    assert h.count("t/exec/ls") == 3
    a = make_action("a", "exec", "t", {"cpu": 1}, klass="t/exec/ls")
    assert a.duration(1, h.estimate(a.klass)) == pytest.approx(3.0)
