"""Issue 35 item 11: `story` says why an exec got the cores it got (tangram.sched.explain).

Identical runs on an idle node alternated between 1 and 2 cores: under the ``priced`` rule
a run's DoP is priced by the forecast load N/C, and N counts, besides the queue, the runs
"in service" by Little's law on the starts of the last 20 s (λ·W) even when none runs:
right after a run, the next is priced as if it shared the node. The placement note now
shows the prices and that forecast.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from tangram import Client
from tangram.model import make_action
from tangram.sched import PoolLoad
from tangram.sched.explain import dop_why
from tangram.sched.price import band, price_bands
from tangram.sched.replay import elastic_amounts
from tangram.testing import SpawnedDaemon
from tangramctl.main import cli


def durations(action, ks):
    return [action.duration(k, 1.0) for k in ks]


@given(
    capacity=st.integers(2, 16),
    hi=st.integers(2, 16),
    effs=st.lists(st.floats(0.05, 1.0), min_size=15, max_size=15),
    queued=st.integers(1, 6),
    running=st.integers(0, 4),
    starts=st.floats(0.0, 2.0),
    mean_s=st.floats(0.0, 60.0),
    short=st.floats(0.0, 3.0),
    envs=st.integers(0, 8),
)
def test_the_explanation_prices_as_the_scheduler_does(
    capacity, hi, effs, queued, running, starts, mean_s, short, envs
):
    """dop_why's k* is the top of the band price_bands gives the same action, for any load."""
    eff = {1: 1.0, **{k: effs[k - 2] for k in range(2, hi + 1)}}
    actions = [
        make_action(f"a{i}", "exec", f"t{i}", {"cpu": [1, hi]}, t1_s=10.0, eff=eff, seq=i)
        for i in range(queued)
    ]
    load = PoolLoad(
        elastic_running=running,
        elastic_starts_per_s=starts,
        elastic_mean_s=mean_s,
        short_units=short,
        envs=envs,
    )
    bands = price_bands(
        actions,
        capacity,
        load,
        lambda a: elastic_amounts(a, capacity),
        lambda a, k: a.duration(k, 1.0),
    )
    why = dop_why(
        actions[0],
        1,
        capacity,
        rule="priced",
        load=load,
        queued=queued,
        capacity=capacity,
        dur=durations,
    )
    assert band(why.allowed, why.best) == bands[actions[0].id]


def test_a_non_elastic_action_says_why() -> None:
    """One allowed amount: fixed, a range without a profile, or a profile that does not pay."""
    fixed = make_action("a1", "exec", "t", {"cpu": 2})
    ranged = make_action("a2", "exec", "t", {"cpu": [1, 2]})

    def why(action, **kw) -> str:
        text = dop_why(
            action, action.min_units, 2, rule="priced", load=None, queued=1, capacity=2,
            dur=durations, **kw,
        )  # fmt: skip
        return str(text)

    assert why(fixed) == "dop 2: fixed (one core count allowed)"
    assert why(ranged).startswith("dop 1: not elastic (a core range needs a profile")
    assert why(fixed, profile_not_elastic="p") == (
        "dop 2: profile 'p' is not elastic (more cores do not pay)"
    )


@pytest.fixture(scope="module")
def sock(daemon: SpawnedDaemon) -> str:
    """A daemon of this module's own: its load window starts empty."""
    with Client(daemon.socket) as c:
        # speed-up 1.05 at 2 cores; t1 = 5 s as planned (the command itself is `true`)
        c.profile_save(
            "pays", dop={"1": 5.0, "2": 4.76}, t1_s=5.0, eff={"1": 1.0, "2": 0.525},
            speedup={"1": 1.0, "2": 1.05}, elastic=True,
        )  # fmt: skip
        c.profile_save(
            "flat", dop={"1": 5.0, "2": 5.46}, t1_s=5.0, eff={"1": 1.0, "2": 0.4575},
            speedup={"1": 1.0, "2": 0.915}, elastic=False,
        )  # fmt: skip
    return daemon.socket


def placed(sock: str, action_id: str) -> str:
    """The story's placement note of ``action_id``, as `tangramctl story --json` gives it."""
    r = CliRunner().invoke(cli, ["--socket", sock, "story", action_id, "--json"])
    events = json.loads(r.output)["events"]
    return next(e["detail"] for e in events if e["event"] == "placed")


def test_identical_runs_get_different_cores_and_the_story_says_why(sock: str) -> None:
    """On the idle node the first run of a profile that pays (1.05 at 2 cores) gets both
    cores: nothing is in service, so 2 cores cost no more than one. The same run right
    after gets one: the first one's start is still in the load window, so λ·W counts it in
    service and the price of the second core (× 1.12) outweighs its 5 % gain. Each story
    says so; `tangramctl story` prints the note whole."""
    with Client(sock) as c:
        first = c.exec(["true"], profile="pays")
        second = c.exec(["true"], profile="pays")
    assert (len(first.cores), len(second.cores)) == (2, 1), (first, second)
    one = placed(sock, first.action_id)
    assert "dop 2 of 1-2: least priced time at 2" in one, one
    assert "N/C=(1 queued + 0.00 in service: 0 running)/2 cores=0.50" in one, one
    two = placed(sock, second.action_id)
    assert "dop 1 of 1-2: least priced time at 1" in two, two
    assert "in service: recent starts 0.05/s × 4.76s, 0 running" in two, two
    assert "k=2 4.76s (E=0.53)×1.12=5.33s" in two, two
    shown = CliRunner().invoke(cli, ["--socket", sock, "story", second.action_id]).output
    assert two in shown  # not cut at the table's cell width


def test_a_profile_that_does_not_pay_runs_on_one_core_and_says_so(sock: str) -> None:
    """An exec naming a non-elastic profile runs on one core; its story names the profile."""
    with Client(sock) as c:
        result = c.exec(["true"], profile="flat")
        plain = c.exec(["true"])
    assert len(result.cores) == 1
    assert "dop 1: profile 'flat' is not elastic (more cores do not pay)" in placed(
        sock, result.action_id
    )
    assert "dop 1: fixed (one core count allowed)" in placed(sock, plain.action_id)
