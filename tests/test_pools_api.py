"""API pools: concurrency, fixed quota windows, lease TTLs, overflow policy, scheduler path."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.model import Action, ActionId, LeaseId, Shortfall, make_action
from tangram.pools.api import OVERFLOW_POLICIES, UNLIMITED_UNITS, ApiPool, Lease


def lid(name: str) -> LeaseId:
    return LeaseId(name)


def api_action(name: str, units: int = 1, api: str = "llm") -> Action:
    return make_action(name, "api", "t", {f"api:{api}": units})


def test_schedpool_fields() -> None:
    """An endpoint is pool api:<name> for resource api:<name>, unlimited dimensions large."""
    pool = ApiPool("llm", concurrency=3, quota=10, period_s=60)
    assert (pool.pool_id, pool.resource, pool.capacity) == ("api:llm", "api:llm", 3)
    assert pool.free_units() == pool.max_single() == 3
    assert pool.extra_cost(api_action("a"), 1) == 0.0
    assert pool.operator().start() == 3
    open_pool = ApiPool("free")
    assert open_pool.capacity == open_pool.free_units() == UNLIMITED_UNITS


def test_overflow_policy_is_validated_and_recorded() -> None:
    """Each endpoint records its overflow policy; unknown policies are named and refused."""
    for policy in OVERFLOW_POLICIES:
        assert ApiPool("x", concurrency=1, overflow=policy).overflow == policy  # type: ignore[arg-type]
    assert ApiPool("x").overflow == "wait"
    with pytest.raises(ValueError, match="allowed: wait, reject, deadline"):
        ApiPool("x", overflow="drop")  # type: ignore[arg-type]


BAD_CONFIGS = [
    ("negative concurrency", {"concurrency": -1}),
    ("negative quota", {"quota": -1}),
    ("zero period", {"period_s": 0.0}),
    ("infinite period", {"period_s": float("inf")}),
    ("zero ttl", {"default_ttl_s": 0.0}),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_configs_rejected(kwargs: dict[str, float]) -> None:
    """Invalid limits are rejected at construction rather than misbehaving later."""
    with pytest.raises(ValueError):
        ApiPool("x", **kwargs)  # type: ignore[arg-type]


def test_concurrency_limits_leases_and_release_is_idempotent() -> None:
    """At most `concurrency` leases at once; releasing twice is harmless."""
    pool = ApiPool("llm", concurrency=2)
    a = pool.acquire(lid("a"), now=0.0)
    assert a == Lease(lid("a"), "llm", 0.0, 60.0)
    assert pool.acquire(lid("b"), now=1.0, ttl_s=5.0) == Lease(lid("b"), "llm", 1.0, 6.0)
    assert pool.acquire(lid("c"), now=2.0) is None
    assert pool.refused == 1
    assert pool.shortfall() == Shortfall("api:llm", 1, 0, 2, "concurrency")
    assert pool.release_lease(lid("a"))
    assert not pool.release_lease(lid("a"))
    assert pool.acquire(lid("c"), now=3.0) is not None
    pool.validate()


def test_acquire_is_idempotent_per_lease_id() -> None:
    """A retried acquire with the same lease id returns the same lease, not a second unit."""
    pool = ApiPool("llm", concurrency=2)
    first = pool.acquire(lid("a"), now=0.0)
    assert pool.acquire(lid("a"), now=5.0) == first
    assert pool.in_use == 1


def test_lease_ttl_returns_units() -> None:
    """An expired lease is reclaimed by advance and its unit returns to the pool."""
    pool = ApiPool("llm", concurrency=1, default_ttl_s=10.0)
    assert pool.acquire(lid("a"), now=0.0) is not None
    assert pool.advance(9.99) == []
    assert pool.free_units() == 0
    assert pool.advance(10.0) == [lid("a")]
    assert pool.free_units() == 1
    assert pool.lease(lid("a")) is None
    assert not pool.release_lease(lid("a"))


def test_renew_extends_a_live_lease_only() -> None:
    """A heartbeat extends a live lease; an expired one cannot be renewed."""
    pool = ApiPool("llm", concurrency=1, default_ttl_s=10.0)
    pool.acquire(lid("a"), now=0.0)
    renewed = pool.renew(lid("a"), now=8.0)
    assert renewed == Lease(lid("a"), "llm", 0.0, 18.0)
    assert pool.advance(15.0) == []
    assert pool.renew(lid("a"), now=18.0) is None
    assert pool.renew(lid("zzz"), now=0.0) is None


def test_expired_leases_are_reported_in_expiry_order() -> None:
    """advance returns every reclaimed lease id, earliest expiry first."""
    pool = ApiPool("llm")
    pool.acquire(lid("late"), now=0.0, ttl_s=3.0)
    pool.acquire(lid("early"), now=0.0, ttl_s=1.0)
    pool.acquire(lid("alive"), now=0.0, ttl_s=9.0)
    assert pool.advance(5.0) == [lid("early"), lid("late")]
    assert [lease.id for lease in pool.leases()] == [lid("alive")]


def test_quota_window_rollover() -> None:
    """Quota counts grants per fixed window [floor(now/P)*P, +P) and resets at the boundary."""
    pool = ApiPool("llm", quota=2, period_s=10.0)
    assert pool.acquire(lid("a"), now=3.0) is not None
    assert pool.release_lease(lid("a"))  # releasing does not refund quota
    assert pool.acquire(lid("b"), now=4.0) is not None
    assert pool.acquire(lid("c"), now=9.9) is None
    assert pool.shortfall() == Shortfall("api:llm", 1, 0, 2, "quota")
    assert pool.next_grant_time(9.9) == 10.0
    assert pool.advance(10.0) == []
    assert (pool.window_start, pool.used_in_window) == (10.0, 0)
    assert pool.acquire(lid("c"), now=10.0) is not None
    assert pool.next_grant_time(10.5) == 10.5


def test_acquire_rolls_a_stale_window_itself() -> None:
    """A grant in a new window is never refused because advance was not called first."""
    pool = ApiPool("llm", quota=1, period_s=1.0)
    assert pool.acquire(lid("a"), now=0.2) is not None
    assert pool.acquire(lid("b"), now=1.2) is not None
    assert pool.window_start == 1.0


NEXT_GRANT_CASES = [
    ("free now", {"concurrency": 2, "quota": 5}, 0, 3.0, 3.0),
    ("quota spent: next window", {"quota": 1, "period_s": 60.0}, 1, 30.0, 60.0),
    ("quota spent, window already over", {"quota": 1, "period_s": 60.0}, 1, 61.0, 61.0),
    ("concurrency blocks: unknown", {"concurrency": 1}, 1, 3.0, None),
    ("both block: unknown", {"concurrency": 1, "quota": 1}, 1, 3.0, None),
]


@pytest.mark.parametrize(
    ("kwargs", "grants", "now", "expected"),
    [c[1:] for c in NEXT_GRANT_CASES],
    ids=[c[0] for c in NEXT_GRANT_CASES],
)
def test_next_grant_time(
    kwargs: dict[str, float], grants: int, now: float, expected: float | None
) -> None:
    """next_grant_time says when the quota window lets a request through, None on concurrency."""
    pool = ApiPool("llm", **kwargs)  # type: ignore[arg-type]
    for i in range(grants):
        assert pool.acquire(lid(f"l{i}"), now=0.0, ttl_s=1000.0) is not None
    assert pool.next_grant_time(now) == expected


def test_scheduler_path_counts_against_both_limits() -> None:
    """Running api actions hold slots counted against concurrency and the window's quota."""
    pool = ApiPool("llm", concurrency=3, quota=4, period_s=10.0)
    a, b = api_action("a"), api_action("b")
    plan = pool.pick_units([(a, 1), (b, 1)])
    assert plan == [(0,), (1,)]
    assert pool.free_units() == 3  # planning changed nothing
    for action, units in zip((a, b), plan, strict=True):
        pool.allocate(action.id, units)
    assert (pool.in_use, pool.used_in_window, pool.free_units()) == (2, 2, 1)
    assert pool.release(a.id) == (0,)
    assert pool.free_units() == 2  # concurrency 3 - 1, quota 4 - 2: released units keep quota
    pool.acquire(lid("l"), now=1.0)  # a lease takes the lowest free slot, 0
    assert pool.free_units() == 1
    with pytest.raises(ValueError, match="in use"):
        pool.allocate(ActionId("c"), (1,))
    with pytest.raises(KeyError):
        pool.release(a.id)
    with pytest.raises(ValueError, match="needs 2"):
        pool.pick_units([(api_action("c"), 2)])
    pool.validate()


def test_never_fits_beyond_the_limits() -> None:
    """An action wanting more units than the endpoint ever allows never fits."""
    assert ApiPool("llm", concurrency=2).never_fits(api_action("a", 3)) is not None
    by_quota = ApiPool("llm", quota=2, period_s=1.0).never_fits(api_action("a", 3))
    assert by_quota is not None and "per 1s" in by_quota.reason
    assert ApiPool("llm", concurrency=3).never_fits(api_action("a", 3)) is None
    assert ApiPool("llm").never_fits(api_action("a", 1, api="other")) is None


@settings(max_examples=80)
@given(
    concurrency=st.integers(0, 3),
    quota=st.integers(0, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["acquire", "release", "advance", "alloc", "free"]),
            st.integers(0, 4),
            st.floats(0.0, 5.0),
        ),
        max_size=40,
    ),
)
def test_random_operations_never_exceed_limits(
    concurrency: int, quota: int, ops: list[tuple[str, int, float]]
) -> None:
    """No sequence of grants, expiries and releases exceeds concurrency or the window quota."""
    pool = ApiPool("llm", concurrency=concurrency, quota=quota, period_s=2.0, default_ttl_s=1.5)
    now = 0.0
    for op, who, dt in ops:
        now += dt
        if op == "acquire":
            pool.acquire(lid(f"l{who}"), now)
        elif op == "release":
            pool.release_lease(lid(f"l{who}"))
        elif op == "advance":
            for expired in pool.advance(now):
                assert pool.lease(expired) is None
            assert all(lease.expires_at > now for lease in pool.leases())
        elif op == "alloc" and pool.free_units() >= 1:
            action = api_action(f"a{who}")
            (units,) = pool.pick_units([(action, 1)])
            with contextlib.suppress(ValueError):  # the action may already hold a unit
                pool.allocate(action.id, units)
        elif op == "free":
            with contextlib.suppress(KeyError):
                pool.release(ActionId(f"a{who}"))
        pool.validate()
