"""exec's stdin / cwd / env, env.put / env.get and shell sessions on a real `tangramd up`."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from tangram.protocol.errors import BadRequest, NotFound
from tangram.protocol.ops import MAX_TRANSFER
from tangram.testing import wait_for
from tangramctl.main import cli


@pytest.fixture
def c(daemon):
    with daemon.client() as client:
        yield client


@pytest.fixture
def env(c):
    env_id = c.env_open()
    yield env_id
    c.env_close(env_id)


def _tar(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            archive.addfile(info)
    return buf.getvalue()


def test_stdin_bytes_reach_the_command(c, env):
    """Input bytes (NUL included) arrive exactly; without stdin the command reads EOF."""
    assert c.exec(["cat"], stdin=b"a\x00b\n").stdout == "a\x00b\n"
    r = c.exec("wc -c", env=env, stdin=b"x" * 200_000)
    assert r.stdout.strip() == "200000"
    assert c.exec(["cat"], env=env, timeout_s=5).stdout == ""
    # a command that ignores its input does not hang on it
    assert c.exec("true", env=env, stdin=b"y" * 1_000_000, timeout_s=5).outcome == "ok"


def test_cwd_and_env_vars(c, env):
    """cwd is a directory inside the environment; env_vars reach the command."""
    c.exec("mkdir -p a/b", env=env)
    r = c.exec('pwd; echo "$GREETING"', env=env, cwd="a/b", env_vars={"GREETING": "hi there"})
    assert r.stdout.endswith("/a/b\nhi there\n")
    r = c.exec("pwd", env=env, cwd="missing")
    assert (r.outcome, r.exit_code) == ("failed", 1)


def test_cwd_cannot_escape(c, env):
    """'..' is refused before scheduling; inside an isolated environment (the default) every
    path is the environment's own: a symlink to /etc leads to its /etc, /tmp is its /tmp."""
    with pytest.raises(BadRequest, match=r"\.\."):
        c.exec("pwd", env=env, cwd="../..")
    c.exec("ln -s /etc out", env=env)
    r = c.exec("pwd -P; touch x 2>/dev/null || echo read-only", env=env, cwd="out")
    assert (r.outcome, r.stdout) == ("ok", "/etc\nread-only\n"), r
    r = c.exec("pwd; echo private > p", env=env, cwd="/tmp")
    assert (r.outcome, r.stdout) == ("ok", "/tmp\n"), r
    assert not os.path.exists("/tmp/p") or Path("/tmp/p").read_text() != "private\n"


def test_put_and_get_files_and_directories(c, env):
    """A file round-trips as bytes; a directory as a tar stream of its contents."""
    assert c.put(env, "data/in.bin", b"\x00\x01payload") == 9
    assert c.exec("cat data/in.bin", env=env).stdout == "\x00\x01payload"
    assert c.get(env, "data/in.bin") == (b"\x00\x01payload", False)
    c.put(env, "tree", _tar({"x.txt": b"x", "sub/y.txt": b"yy"}), tar=True)
    assert c.exec("cat tree/x.txt tree/sub/y.txt", env=env).stdout == "xyy"
    data, is_tar = c.get(env, "tree")
    assert is_tar
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        assert sorted(archive.getnames()) == ["sub", "sub/y.txt", "x.txt"]
    with pytest.raises(NotFound):
        c.get(env, "nothing-here")


def test_transfers_resolve_inside_the_environment(c, env):
    """On the isolated default a put's or get's path is the environment's own, as a
    command's cwd is: symlinks go where they go inside it, absolute paths are its root's
    (``..`` stays refused by the op table). The host's root-only files stay unreadable,
    its directories unwritable (both ``bad_request``: as the environment's user), and no
    tar member leaves its directory."""
    c.exec("ln -s /etc out; ln -s / root", env=env)
    passwd = c.exec("cat /etc/passwd", env=env).stdout.encode()
    for path in ("out/passwd", "/etc/passwd", "root/etc/passwd"):
        assert c.get(env, path) == (passwd, False), path
    for path in ("/etc/shadow", "out/shadow"):
        with pytest.raises(BadRequest, match="ermission denied"):
            c.get(env, path)
    with pytest.raises(BadRequest, match="ermission denied"):
        c.put(env, "out/evil", b"x")
    with pytest.raises(BadRequest):
        c.put(env, "t1", _tar({"../evil": b"x"}), tar=True)
    with pytest.raises(BadRequest):
        c.put(env, "t2", _tar({}, links={"l": "/etc"}), tar=True)
    with pytest.raises(BadRequest, match="ermission denied"):
        c.put(env, "out", _tar({"evil": b"x"}), tar=True)
    with pytest.raises(BadRequest):
        c.put(env, "t3", b"not a tar stream", tar=True)
    c.put(env, "dir/f", b"x")
    with pytest.raises(BadRequest, match="directory"):
        c.put(env, "dir", b"x")  # a file over a directory
    assert not os.path.exists("/etc/evil")


def test_a_fifo_is_refused_not_waited_on(c, env):
    """Reading a FIFO would wait for a writer forever: get refuses it, fetch leaves it out."""
    assert c.exec("mkfifo pipe", env=env).outcome == "ok"
    with pytest.raises(BadRequest, match="not a regular file"):
        c.get(env, "pipe")
    r = c.exec("true", env=env, fetch=["pipe"], timeout_s=5)
    assert r.outcome == "ok" and r.files == {} and "pipe" in r.detail


def test_transfer_size_cap(c, env):
    """env.put over the cap is refused by the op table; env.get over it by the daemon."""
    with pytest.raises(BadRequest, match="at most"):
        c.put(env, "big", b"x" * (MAX_TRANSFER + 1))
    c.exec(f"head -c {MAX_TRANSFER + 1} /dev/zero > big", env=env)
    with pytest.raises(BadRequest, match="more than"):
        c.get(env, "big")


def test_session_keeps_state_across_runs_and_timeouts(c, env):
    """cwd, variables and functions persist; a timeout interrupts and the shell survives."""
    sid = c.session_open(env)
    assert c.exec("mkdir -p w && cd w; X=41; f() { echo $((X + $1)); }", session=sid).ok
    r = c.exec("pwd; f 1", session=sid)
    assert r.stdout.endswith("/w\n42\n"), r
    r = c.exec("echo before; sleep 30", session=sid, timeout_s=0.5)
    assert (r.outcome, r.stdout) == ("timeout", "before\n")
    assert r.exec_s < 5
    assert c.exec("f 2; cat", session=sid, stdin=b"input").stdout == "43\ninput"
    r = c.exec("if then", session=sid)  # a syntax error is the command's failure
    assert r.outcome == "failed" and "syntax error" in r.stderr
    assert c.exec("echo $X", session=sid).stdout == "41\n"
    c.session_close(sid)
    with pytest.raises(NotFound):
        c.exec("true", session=sid)


def test_session_run_is_an_action_pinned_to_its_cores(c, env):
    """Each run holds exactly its cores; jobs the shell left are re-pinned with it."""
    sid = c.session_open(env)
    c.exec("sleep 60 & echo $! > bg.pid", session=sid)
    for cpus in (2, 1):
        r = c.exec(
            "grep Cpus_allowed_list /proc/self/status /proc/$(cat bg.pid)/status",
            session=sid,
            cpus=cpus,
        )
        lines = {line.rsplit(":", 1)[1].strip() for line in r.stdout.splitlines()}
        want = ",".join(map(str, r.cores)) if cpus == 1 else f"{min(r.cores)}-{max(r.cores)}"
        assert lines == {want}, r
        assert len(r.cores) == cpus
    c.session_close(sid)


def running(argv: list[str]) -> bool:
    """Whether a process of this test's (the daemon's commands included) runs ``argv``."""
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.cmdline() == argv:
                return True
    return False


def test_session_interrupt_and_busy(daemon, c, env):
    """interrupt stops the running command (the shell stays); a busy shell refuses a second."""
    sid = c.session_open(env)
    results = []

    def exec_in_session() -> None:
        with daemon.client() as other:
            results.append(other.exec("sleep 37; echo never", session=sid))

    worker = threading.Thread(target=exec_in_session)
    worker.start()
    wait_for(lambda: running(["sleep", "37"]), 10, "the session's command running")
    with pytest.raises(BadRequest, match="busy"):
        c.exec("true", session=sid)
    assert c.session_interrupt(sid) is True
    worker.join(10)
    assert results[0].outcome == "failed" and "never" not in results[0].stdout
    assert c.exec("echo alive", session=sid).stdout == "alive\n"
    assert c.session_interrupt(sid) is False
    c.session_close(sid)


def test_cli_exec_options_and_env_transfer(daemon, env, tmp_path):
    """`exec --cwd --env-var --stdin -`, `env put` (file, directory) and `env get`."""

    def ctl(*args: str, input: bytes | None = None):
        return CliRunner().invoke(cli, ["--socket", daemon.socket, *args], input=input)

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("in a dir")
    (tmp_path / "one.txt").write_text("one")
    assert ctl("env", "put", env, str(tmp_path / "one.txt"), "cli/one.txt").exit_code == 0
    assert ctl("env", "put", env, str(src), "cli/tree").exit_code == 0
    r = ctl("exec", "--env", env, "--cwd", "cli", "--env-var", "K=v", "--stdin", "-", "--",
            "sh", "-c", 'cat one.txt tree/d/f.txt; echo " $K"; cat', input=b"piped")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output == "onein a dir v\npiped"
    assert ctl("env", "get", env, "cli/one.txt").output == "one"
    out = tmp_path / "back"
    assert ctl("env", "get", env, "cli/tree", "-o", str(out)).exit_code == 0
    assert (out / "d" / "f.txt").read_text() == "in a dir"
