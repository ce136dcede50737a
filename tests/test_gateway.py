"""`tangramd http` as SandboxFusion: real clients (sandbox-fusion, verl) against a real stack,
with the gateway in its own process and in the daemon's (`tangramd up --http`)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import sandbox_fusion as sfc
from verl_loader import verl_module

from tangram.testing import spawn_gateway


@pytest.fixture(scope="module", params=["separate", "in_process"])
def gateway_in_process(request: pytest.FixtureRequest) -> bool:
    """Every test runs against a `tangramd http` and against `tangramd up --http`."""
    return bool(request.param == "in_process")


def post_run_code(stack, **body) -> dict:
    """POST ``body`` to the gateway's /run_code; its JSON answer (the status must be 200)."""
    r = httpx.post(f"{stack.url}/run_code", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.usefixtures("sandbox_fusion_endpoint")
def test_client_run_code_stdout_stderr_stdin(stack):
    """The sandbox-fusion client gets stdout, stderr and its stdin through one exec action."""
    code = "import sys\nname = input()\nprint('hi', name)\nprint('oops', file=sys.stderr)"
    resp = sfc.run_code(
        sfc.RunCodeRequest(code=code, language="python", stdin="ada\n"), max_attempts=1
    )
    assert resp.status == sfc.RunStatus.Success
    assert resp.run_result.status == sfc.CommandRunStatus.Finished
    assert (resp.run_result.stdout, resp.run_result.stderr) == ("hi ada\n", "oops\n")
    assert resp.run_result.return_code == 0 and resp.run_result.execution_time > 0
    bash = sfc.run_code(sfc.RunCodeRequest(code="echo $((6 * 7))", language="bash"))
    assert bash.run_result.stdout == "42\n"


def test_nonzero_exit_and_timeout_are_failed_not_errors(stack):
    """Exit 3 is Failed with return_code 3; a timeout is Failed with TimeLimitExceeded."""
    failed = post_run_code(stack, code="import sys; print('x'); sys.exit(3)", language="python")
    assert failed["status"] == "Failed" and failed["message"] == ""
    assert failed["run_result"]["status"] == "Finished"
    assert failed["run_result"]["return_code"] == 3 and failed["run_result"]["stdout"] == "x\n"
    spin = "print('early', flush=True)\nwhile True: pass"
    slow = post_run_code(stack, code=spin, language="python", run_timeout=0.5)
    assert slow["status"] == "Failed"
    rr = slow["run_result"]
    assert rr["status"] == "TimeLimitExceeded" and rr["stdout"] == "early\n"
    assert isinstance(rr["stderr"], str) and 0.4 < rr["execution_time"] < 5


def test_files_in_and_out_and_a_fresh_sandbox_per_request(stack):
    """files are written before the run, fetch_files come back; nothing survives a request."""
    data = base64.b64encode(b"1 2 3\n").decode()
    code = "read a b c < in/nums.txt; echo $((a + b + c)) > sum.txt; touch leftover"
    resp = post_run_code(stack, code=code, language="bash", files={"in/nums.txt": data},
               fetch_files=["sum.txt", "missing.txt"])  # fmt: skip
    assert resp["status"] == "Success", resp
    assert resp["files"] == {"sum.txt": base64.b64encode(b"6\n").decode()}
    again = post_run_code(stack, code="ls", language="bash")
    assert again["run_result"]["stdout"] == "main.sh\n"  # a fresh environment: no leftover
    cpp = post_run_code(stack, code='#include <cstdio>\nint main(){puts("c++");}', language="cpp")
    assert cpp["compile_result"]["return_code"] == 0 and cpp["run_result"]["stdout"] == "c++\n"
    broken = post_run_code(stack, code="int main(){", language="cpp")
    assert broken["status"] == "Failed" and broken["run_result"] is None
    assert broken["compile_result"]["return_code"] != 0


@pytest.mark.usefixtures("sandbox_fusion_endpoint")
def test_concurrent_requests_overlap_on_free_cores(stack):
    """run_concurrent and run_code_async: calls run side by side when cores are free."""
    req = sfc.RunCodeRequest(code="import time; time.sleep(1); print('done')", language="python")
    started = time.monotonic()
    results = sfc.run_concurrent(sfc.run_code, args=[[req], [req]], concurrency=2)
    wall = time.monotonic() - started
    assert all(r.run_result.stdout == "done\n" for r in results)
    serial = sum(r.run_result.execution_time for r in results)  # one after the other
    assert wall < serial, f"two runs of {serial:.2f} s in all took {wall:.2f} s: no overlap"

    async def both() -> list:
        return await asyncio.gather(*(sfc.run_code_async(req) for _ in range(2)))

    started = time.monotonic()
    results = asyncio.run(both())
    assert [r.status for r in results] == [sfc.RunStatus.Success] * 2
    assert time.monotonic() - started < sum(r.run_result.execution_time for r in results)


def test_verl_reward_functions_score_through_the_gateway(stack):
    """verl's compute_score / check_correctness grade code through /run_code unchanged."""
    verl_sf = verl_module("verl.utils.reward_score.sandbox_fusion")
    cases = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    semaphore = threading.Semaphore(4)
    url = f"{stack.url}/run_code"
    score, meta = verl_sf.compute_score(url, semaphore, 256, right, cases)
    assert score == 1.0, meta
    score, meta = verl_sf.compute_score(url, semaphore, 256, wrong, cases)
    assert score == 0.0 and meta[0]["status"] == "wrong_answer", meta
    results, meta = verl_sf.check_correctness(url, cases, "while True: pass", timeout=1)
    assert results == [-3, -3] and meta[0]["status"] == "timeout", meta


def test_bad_requests_get_422_and_the_gateway_stays_up(stack):
    """Malformed bodies are 422 with a JSON detail; an impossible sandbox is SandboxError."""
    bad = [
        b"{not json",
        b'{"language": "python"}',
        b'{"code": "print(1)", "language": "brainfuck"}',
        b'{"code": 5, "language": "python", "run_timeout": "soon"}',
        b'{"code": "x", "language": "python", "files": {"a": 1}}',
        b"[]",
    ]
    for body in bad:
        r = httpx.post(f"{stack.url}/run_code", content=body,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 422, (body, r.text)
        assert "detail" in r.json()
    huge = post_run_code(stack, code="print(1)", language="python", memory_limit_MB=1 << 30)
    assert huge["status"] == "SandboxError" and huge["message"]
    assert huge["run_result"]["status"] == "Error" and huge["run_result"]["stdout"] == ""
    escape = post_run_code(stack, code="ls", language="bash", files={"../x": "eA=="})
    assert escape["status"] == "SandboxError" and ".." in escape["message"]
    r = httpx.get(f"{stack.url}/no/such/route")
    assert r.status_code == 404
    assert post_run_code(stack, code="print(1)", language="python")["status"] == "Success"


def test_served_alike_on_the_fast_path_and_through_fastapi(stack):
    """A JSON body Gate serves itself and the same body FastAPI serves (sent as a +json
    media type, which only FastAPI takes) get the same answer; both are counted as
    /run_code. A chunked body and a charset parameter take the fast path too."""
    body = {
        "code": "import sys\nprint(open('in.txt').read(), sys.stdin.read())\n"
        "open('o', 'w').write('x')",
        "language": "python",
        "stdin": "piped",
        "files": {"in.txt": base64.b64encode(b"given").decode()},
        "fetch_files": ["o", "missing"],
        "extra_field": "ignored",
    }
    raw = json.dumps(body).encode()
    answers = []
    for content_type in ("application/json", "application/vnd.test+json",
                         "Application/JSON; charset=utf-8"):  # fmt: skip
        r = httpx.post(f"{stack.url}/run_code", content=raw,
                       headers={"Content-Type": content_type}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        answer = r.json()
        answer["run_result"]["execution_time"] = None
        answers.append(answer)
    chunked = httpx.post(f"{stack.url}/run_code", content=iter([raw[:10], raw[10:]]),
                         headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    answer = chunked.json()
    answer["run_result"]["execution_time"] = None
    answers.append(answer)
    assert answers[0]["run_result"]["stdout"] == "given piped\n", answers[0]
    assert answers[0]["files"] == {"o": base64.b64encode(b"x").decode()}
    assert all(a == answers[0] for a in answers), answers
    text = httpx.get(f"{stack.url}/metrics").text
    assert 'tangram_gateway_requests_total{code="200",route="/run_code"}' in text


def test_metrics_expose_pools_queues_and_action_histograms(stack):
    """GET /metrics: pool units, queue length, clients, actions by kind/outcome, ACT buckets."""
    post_run_code(stack, code="print(1)", language="python")
    post_run_code(stack, code="raise SystemExit(1)", language="python")
    text = httpx.get(f"{stack.url}/metrics").text
    for needle in (
        'tangram_pool_free_units{pool="cpu:local"} 2.0',
        'tangram_pool_capacity_units{pool="cpu:local"} 2.0',
        'tangram_queue_length{kind="exec"}',
        "tangram_connected_clients",
        "tangram_daemon_up 1.0",
        'tangram_gateway_actions_total{kind="run_code/python",outcome="ok"}',
        'tangram_gateway_actions_total{kind="run_code/python",outcome="failed"}',
        'tangram_action_act_seconds_bucket{kind="run_code/python",le="0.5"}',
        'tangram_action_queue_seconds_count{kind="run_code/python"}',
        'tangram_action_exec_seconds_sum{kind="run_code/python"}',
    ):
        assert needle in text, needle
    dashboard = (Path(__file__).parent.parent / "docs" / "grafana-gateway.json").read_text()
    for name in set(re.findall(r"tangram_[a-z_]+", dashboard)):
        assert name in text, f"docs/grafana-gateway.json plots {name}, which /metrics lacks"


def test_api_key_is_required_when_configured(stack, tmp_path):
    """With --api-key-file: no key or a wrong one is 401; the right one is served."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    with spawn_gateway(stack.daemon.socket, tmp_path, "--api-key-file", str(key_file)) as gw:
        body = {"code": "print(1)", "language": "python"}
        assert httpx.post(f"{gw.url}/run_code", json=body).status_code == 401
        for wrong in ("s3cret", "s3cret-key2", ""):
            r = httpx.post(f"{gw.url}/run_code", json=body, headers={"X-API-Key": wrong})
            assert r.status_code == 401
        assert httpx.get(f"{gw.url}/metrics").status_code == 401
        r = httpx.post(f"{gw.url}/run_code", json=body, headers={"X-API-Key": "s3cret-key"})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n"


def test_the_key_in_the_path_serves_sandbox_fusions_own_client(stack, tmp_path):
    """SandboxFusion's client sends no header: with the key as the URL's ``/k/KEY`` prefix
    it is served (fast path and FastAPI routes alike); a wrong key there is 401, and the
    prefix never stands in for the header's absence on a keyless gateway."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    with spawn_gateway(stack.daemon.socket, tmp_path, "--api-key-file", str(key_file)) as gw:
        request = sfc.RunCodeRequest(code="print(6 * 7)", language="python")
        with pytest.raises(Exception, match="401"):
            sfc.run_code(request, endpoint=gw.url, max_attempts=1)
        resp = sfc.run_code(request, endpoint=f"{gw.url}/k/s3cret-key", max_attempts=1)
        assert resp.status == sfc.RunStatus.Success and resp.run_result.stdout == "42\n"
        assert httpx.get(f"{gw.url}/k/s3cret-key/health").status_code == 200
        assert httpx.get(f"{gw.url}/k/wrong/health").status_code == 401
        assert httpx.get(f"{gw.url}/k/s3cret-key").status_code == 404
    assert httpx.get(f"{stack.url}/k/anything/health").status_code == 404


def test_daemon_unreachable_is_a_sandbox_error_not_a_crash(tmp_path):
    """Without a daemon behind it the gateway answers SandboxError, /metrics says down."""
    with spawn_gateway(str(tmp_path / "no-daemon.sock"), tmp_path) as gw:
        r = httpx.post(f"{gw.url}/run_code", json={"code": "print(1)", "language": "python"})
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "SandboxError" and "cannot connect" in body["message"]
        assert "tangram_daemon_up 0.0" in httpx.get(f"{gw.url}/metrics").text
        assert httpx.get(f"{gw.url}/health").status_code == 503
        assert gw.proc.poll() is None
    assert "Traceback" not in gw.log(), gw.log()


def test_the_gateway_says_where_it_serves_and_warns_of_a_missing_daemon(stack, tmp_path):
    """``tangramd http`` prints its address and routes at start-up, and warns, naming the
    socket, when no daemon answers there (it still serves, so a daemon started later is
    used); with a daemon there it gives no warning."""
    missing = str(tmp_path / "nobody.sock")
    with spawn_gateway(missing, tmp_path) as lonely:
        text = lonely.log_path.read_text()
        health = httpx.get(f"{lonely.url}/health", timeout=10)
    assert "tangramd http: serving http://127.0.0.1:" in text and "/run_code" in text
    assert f"warning: no tangramd answers at {missing}" in text
    assert health.status_code in (200, 503)
    with spawn_gateway(stack.daemon.socket, tmp_path) as served:
        text = served.log_path.read_text()
    assert "serving http://" in text and "no tangramd answers" not in text
    # a gateway run as root hands its callers' commands to the daemon as root's
    assert ("warning: this gateway runs as root" in text) == (os.geteuid() == 0)
