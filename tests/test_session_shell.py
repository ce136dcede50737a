"""The process backend's session shell (``tangramd/backends/shell.py``) on a real daemon:
what a command's text may hold reaches bash exactly, a command longer than the pipe to
the shell gets through, and the jobs a run leaves are found by the next (pinned, spared)."""

from __future__ import annotations

import pytest


@pytest.fixture
def c(daemon):
    with daemon.client() as client:
        yield client


@pytest.fixture
def env(c):
    env_id = c.env_open()
    yield env_id
    c.env_close(env_id)


@pytest.mark.parametrize(
    "command, stdout",
    [
        ("echo 'it'\"'\"'s'; echo \"$((6 * 7))\" \\\\ \\$HOME", "it's\n42 \\ $HOME\n"),
        ("cat <<'EOF'\n$X 'q' \"d\"\nEOF", "$X 'q' \"d\"\n"),
        ("printf '%s\\n' a\\\nb", "ab\n"),  # an escaped line break joins the lines
        ("echo one\n\n\necho two\n\n", "one\ntwo\n"),
        ("echo !!; echo '!$'", "!!\n!$\n"),  # no history expansion
    ],
)
def test_command_text_reaches_bash_exactly(c, env, command, stdout):
    sid = c.session_open(env)
    r = c.exec(command, session=sid)
    assert (r.exit_code, r.stdout, r.stderr) == (0, stdout, ""), r
    c.session_close(sid)


def test_long_command_and_state(c, env):
    """A 300 kB command (several pipe buffers: the shell reads while it is written); the
    variables it sets stay for the next command."""
    sid = c.session_open(env)
    body = "".join(f"V{i}={i}\n" for i in range(30000))
    assert len(body) > 4 * 65536
    r = c.exec(body + "echo $V29999", session=sid, timeout_s=60)
    assert (r.exit_code, r.stdout) == (0, "29999\n"), r
    assert c.exec("echo $V123", session=sid).stdout == "123\n"
    c.session_close(sid)


def test_jobs_left_by_a_run_are_found_by_the_next(c, env):
    """A run after a quiet one (nothing left running: no look needed) and after one that
    left a job: the job is re-pinned with the shell and a timeout spares it."""
    sid = c.session_open(env)
    for _ in range(3):
        assert c.exec("true", session=sid).ok
    c.exec("sleep 60 & echo $! > bg.pid", session=sid)
    r = c.exec("grep Cpus_allowed_list /proc/$(cat bg.pid)/status", session=sid)
    assert r.stdout.split(":")[1].strip() == ",".join(map(str, r.cores)), r
    r = c.exec("sleep 30", session=sid, timeout_s=0.3)
    assert r.outcome == "timeout"
    r = c.exec("kill -0 $(cat bg.pid) && echo alive; kill $(cat bg.pid)", session=sid)
    assert r.stdout == "alive\n", r
    c.session_close(sid)
