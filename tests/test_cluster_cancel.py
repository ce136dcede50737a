"""``Backend.cancel``: a cluster node kills the execs its coordinator has already ended (see
test_cluster_faults for the node side). Each real backend: the process backend and Docker
(agent and plain `docker exec`; marked `docker`, CI starts dockerd)."""

from __future__ import annotations

import asyncio
import time

from backend_conformance import BOTH_CORES, backend_fixtures, new_env, req, run

from tangram.testing import wait_for_async

docker_client, backend = backend_fixtures("cn")


def test_cancel_kills_a_running_exec_and_what_it_started(backend):
    """cancel(action id) ends the exec at once (as SIGKILL would), background children
    included; other actions' execs run on; an unknown or finished action is False."""
    # in environments and on cores of their own, as the scheduler places them; the first
    # with a background child holding the output pipes (the exec ends when it is gone too)
    doomed_env = new_env(backend)
    started_cmd = "echo up > started; sleep 30 & sleep 30"
    doomed = req(doomed_env, started_cmd, (BOTH_CORES[0],), action_id="a1f")
    other = req(new_env(backend), "sleep 1; echo done", (BOTH_CORES[-1],), action_id="a20")

    async def scenario():
        tasks = [asyncio.ensure_future(backend.exec(r)) for r in (doomed, other)]
        await wait_for_async(  # the doomed exec runs (the other one's sleep is long enough)
            lambda: backend.get(doomed_env, "started", max_bytes=64),
            10,
            "the doomed exec started",
            ignore=(FileNotFoundError,),
        )
        started = time.monotonic()
        assert await backend.cancel("a1f") is True
        result = await asyncio.wait_for(tasks[0], 10)
        took = time.monotonic() - started
        assert await backend.cancel("a1") is False  # no prefix match: ids are exact
        second = await tasks[1]
        return result, took, second

    result, took, second = run(scenario())
    assert result.outcome != "ok" and result.exit_code == 137, result
    assert took < 5, took
    assert result.detail != "output pipes held open by an escaped descendant", result
    assert (second.outcome, second.stdout) == ("ok", "done\n"), second
    assert run(backend.cancel("a1f")) is False  # finished
