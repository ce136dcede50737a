"""Isolation between HTTP callers (issue 30, item 4), against a real daemon and gateway:
unguessable environment ids, an environment belongs to the API key that opened it,
``[http] keys`` maps a key to its own user, throwaway ``/run_code`` runs share no temp."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import running_stack
from hostile_user import LocalUser, local_user

ENV_ID = re.compile(r"e[0-9a-f]{32}")


@pytest.fixture(scope="module")
def user() -> Iterator[LocalUser]:
    """A throwaway unprivileged user, beta's key's own."""
    with local_user() as u:
        yield u


@pytest.fixture(scope="module", params=["separate", "in_process"])
def keyed(request: pytest.FixtureRequest, user: LocalUser) -> Iterator[tuple]:
    """A stack whose gateway accepts two keys from ``[http] keys``: alpha, and beta (its
    own user in the daemon's process; the gateway's user in a separate one)."""
    with tempfile.TemporaryDirectory(prefix="tgk-", dir="/tmp") as where:
        os.chmod(where, 0o755)  # beta's commands reach their environments through it
        yield from _keyed(Path(where), request.param == "in_process", user)


def _keyed(tmp: Path, in_process: bool, user: LocalUser) -> Iterator[tuple]:
    alpha, beta = uuid.uuid4().hex, uuid.uuid4().hex
    keys = tmp / "http-keys"
    keys.write_text(f"# test keys\n{alpha}\n{beta} {user.name if in_process else ''}\n")
    http = f'\n[http]\nkeys = "{keys}"\n'
    config = tmp / "http.toml"
    config.write_text(http)
    args = () if in_process else ("--config", str(config))
    with running_stack(tmp, *args, in_process=in_process, config=http) as stack:
        yield stack, alpha, beta, in_process


def _as(key: str) -> dict[str, str]:
    return {"X-API-Key": key}


def _execute(url: str, env: str, key: str, cmd: str) -> httpx.Response:
    body = {"command": cmd, "shell": True, "timeout": 30}
    return httpx.post(f"{url}/swerex/{env}/execute", json=body, headers=_as(key), timeout=60)


def test_an_environment_belongs_to_the_key_that_opened_it(keyed):
    """Another key's requests for an environment are not_found (execute, close, DELETE);
    its opener's work, and its id is 128 random bits."""
    stack, alpha, beta, _ = keyed
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 401
    opened = httpx.post(f"{stack.url}/envs", json={}, headers=_as(alpha), timeout=60)
    assert opened.status_code == 200, opened.text
    env = opened.json()["id"]
    assert ENV_ID.fullmatch(env), env
    ok = _execute(stack.url, env, alpha, "echo mine > f; cat f")
    assert ok.status_code == 200 and ok.json()["stdout"] == "mine\n", ok.text
    for denied in (
        _execute(stack.url, env, beta, "cat f"),
        httpx.post(f"{stack.url}/swerex/{env}/close", headers=_as(beta), timeout=60),
        httpx.delete(f"{stack.url}/envs/{env}", headers=_as(beta), timeout=60),
    ):
        assert denied.status_code == 404, denied.text
        assert "not_found" in denied.text
    still = _execute(stack.url, env, alpha, "cat f")
    assert still.status_code == 200 and still.json()["stdout"] == "mine\n", still.text
    closed = httpx.delete(f"{stack.url}/envs/{env}", headers=_as(alpha), timeout=60)
    assert closed.status_code == 200, closed.text


def test_a_key_runs_commands_as_its_own_user(keyed, user):
    """Under `tangramd up --http` a key of [http] keys with a user runs its commands as
    that uid; a key without one as the gateway's callers' user (here the daemon's)."""
    stack, alpha, beta, in_process = keyed
    host_uid = (  # the host uid it runs as: its own, or the one root inside its box maps to
        "import os\n"
        "inside, outside, _ = open('/proc/self/uid_map').read().split()[:3]\n"
        "print(int(outside) + os.getuid() - int(inside))"
    )
    code = {"code": host_uid, "language": "python"}
    uids = {}
    for name, key in (("alpha", alpha), ("beta", beta)):
        r = httpx.post(f"{stack.url}/run_code", json=code, headers=_as(key), timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text
        uids[name] = int(r.json()["run_result"]["stdout"])
    expected_beta = user.uid if in_process else uids["alpha"]
    assert uids["beta"] == expected_beta, uids
    if in_process:
        assert uids["alpha"] != user.uid


def test_throwaway_run_code_shares_no_temp(keyed):
    """Two /run_code requests share no /tmp and no TMPDIR: what one leaves there the next
    cannot see."""
    stack, alpha, _, _ = keyed
    name = f"tangram-probe-{uuid.uuid4().hex}"
    leave = (
        "import os, tempfile\n"
        f"open('/tmp/{name}', 'w').write('x')\n"
        f"open(os.path.join(tempfile.gettempdir(), '{name}'), 'w').write('x')\n"
        "print(tempfile.gettempdir())"
    )
    look = (
        "import os, tempfile\n"
        f"print(os.path.exists('/tmp/{name}'),"
        f" os.path.exists(os.path.join(tempfile.gettempdir(), '{name}')))\n"
        "print(tempfile.gettempdir())"
    )
    outs = []
    for code in (leave, look):
        r = httpx.post(
            f"{stack.url}/run_code",
            json={"code": code, "language": "python"},
            headers=_as(alpha),
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text
        outs.append(r.json()["run_result"]["stdout"].splitlines())
    assert outs[1][0] == "False False", outs
    assert outs[0][-1] != outs[1][-1], outs  # each run its own TMPDIR
    assert not Path(f"/tmp/{name}").exists()  # not the host's /tmp either


def test_separate_gateway_refuses_per_key_users(tmp_path, user):
    """A separate `tangramd http` cannot speak for another uid: a per-key user in
    [http] keys exits 2 at start-up naming it, before anything is bound."""
    keys = tmp_path / "http-keys"
    keys.write_text(f"{uuid.uuid4().hex} {user.name}\n")
    config = tmp_path / "http.toml"
    config.write_text(f'[http]\nkeys = "{keys}"\n')
    cmd = [sys.executable, "-m", "tangramd.main", "http", "--listen", "127.0.0.1:1"]
    cmd += ["--socket", str(tmp_path / "none.sock"), "--config", str(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"user {user.name!r}" in done.stderr and "tangramd up --http" in done.stderr


def test_fork_through_the_gateway_belongs_to_the_key(keyed):
    """POST /envs/{id}/fork: the children start from the source's files, have SWE-ReX URLs
    and belong to the key that forked; another key's fork is not_found; a bad n is 400
    naming n."""
    stack, alpha, beta, _ = keyed
    env = httpx.post(f"{stack.url}/envs", json={}, headers=_as(alpha), timeout=60).json()["id"]
    assert _execute(stack.url, env, alpha, "echo prepared > f").status_code == 200
    forked = httpx.post(
        f"{stack.url}/envs/{env}/fork", json={"n": 2}, headers=_as(alpha), timeout=60
    )
    assert forked.status_code == 200, forked.text
    body = forked.json()
    assert len(body["ids"]) == 2 and body["swerex_urls"] == [
        f"{stack.url}/swerex/{i}" for i in body["ids"]
    ]
    for child in body["ids"]:
        ok = _execute(stack.url, child, alpha, "cat f")
        assert ok.status_code == 200 and ok.json()["stdout"] == "prepared\n", ok.text
        assert _execute(stack.url, child, beta, "cat f").status_code == 404
    denied = httpx.post(
        f"{stack.url}/envs/{env}/fork", json={"n": 1}, headers=_as(beta), timeout=60
    )
    assert denied.status_code == 404 and "not_found" in denied.text, denied.text
    bad = httpx.post(f"{stack.url}/envs/{env}/fork", json={"n": 0}, headers=_as(alpha), timeout=60)
    assert bad.status_code == 400 and "n: expected int" in bad.text, bad.text
    for gone in (env, *body["ids"]):
        assert httpx.delete(f"{stack.url}/envs/{gone}", headers=_as(alpha), timeout=60).is_success
