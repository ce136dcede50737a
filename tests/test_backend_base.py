"""The backend-independent pieces: the pytest -n rewrite, output capping, agent framing,
path confinement."""

from __future__ import annotations

import os

import pytest

from tangramd.backends import agent
from tangramd.backends.base import (
    TRUNCATION_MARKER,
    ExecRequest,
    OutputBuffer,
    PathEscape,
    cap_output,
    confine_real,
    exit_code_from_returncode,
    rewrite_pytest,
)

REWRITES = [
    # (name, cmd, cores, elastic, expected)
    ("bare pytest", ["pytest"], 2, True, ["pytest", "-n", "2"]),
    ("py.test", ["py.test", "-q"], 4, True, ["py.test", "-n", "4", "-q"]),
    ("path to pytest", ["/venv/bin/pytest", "t"], 2, True, ["/venv/bin/pytest", "-n", "2", "t"]),
    (
        "python -m",
        ["python", "-m", "pytest", "-x"],
        3,
        True,
        ["python", "-m", "pytest", "-n", "3", "-x"],
    ),
    (
        "python3.11 -m",
        ["python3.11", "-m", "pytest"],
        2,
        True,
        ["python3.11", "-m", "pytest", "-n", "2"],
    ),
    ("replaces -n N", ["pytest", "-n", "8", "t"], 2, True, ["pytest", "-n", "2", "t"]),
    ("replaces -nN", ["pytest", "-n8", "t"], 2, True, ["pytest", "-n", "2", "t"]),
    ("replaces -n auto", ["pytest", "-n", "auto"], 2, True, ["pytest", "-n", "2"]),
    ("replaces --numprocesses=", ["pytest", "--numprocesses=5"], 2, True, ["pytest", "-n", "2"]),
    (
        "replaces --numprocesses N",
        ["pytest", "--numprocesses", "5", "-q"],
        2,
        True,
        ["pytest", "-n", "2", "-q"],
    ),
    ("one core unchanged", ["pytest", "-n", "4"], 1, True, ["pytest", "-n", "4"]),
    ("opted out unchanged", ["pytest"], 4, False, ["pytest"]),
    ("not pytest", ["python", "-m", "unittest"], 4, True, ["python", "-m", "unittest"]),
    ("pytest as an argument", ["echo", "pytest"], 4, True, ["echo", "pytest"]),
    ("python script", ["python", "pytest.py"], 4, True, ["python", "pytest.py"]),
    ("shell bare", "pytest", 2, True, "pytest -n 2"),
    ("shell args", "pytest -x tests", 2, True, "pytest -n 2 -x tests"),
    ("shell python3 -m", "python3 -m pytest -q", 2, True, "python3 -m pytest -n 2 -q"),
    ("shell after cd", "cd /repo && pytest -q", 2, True, "cd /repo && pytest -n 2 -q"),
    ("shell quoted cd", "cd 'a b' && py.test", 2, True, "cd 'a b' && py.test -n 2"),
    ("shell replaces -n", "pytest -n 4 -x", 2, True, "pytest -n 2 -x"),
    ("shell replaces -nN", "pytest -n4", 2, True, "pytest -n 2"),
    ("shell replaces --numprocesses", "pytest --numprocesses=auto t", 2, True, "pytest -n 2 t"),
    ("shell pipeline", "pytest t | tail -1", 2, True, "pytest -n 2 t | tail -1"),
    ("shell and-chain", "pytest t && echo ok", 2, True, "pytest -n 2 t && echo ok"),
    ("shell keeps quoted spaces", 'pytest -k "a  b"', 2, True, 'pytest -n 2 -k "a  b"'),
    ("shell later -n untouched", "pytest t; other -n 3", 2, True, "pytest -n 2 t; other -n 3"),
    ("shell not pytest", "echo pytest", 2, True, "echo pytest"),
    ("shell pytester", "pytester run", 2, True, "pytester run"),
    ("shell one core", "pytest -n 3", 1, True, "pytest -n 3"),
    ("shell opted out", "pytest", 2, False, "pytest"),
]


@pytest.mark.parametrize(
    ("cmd", "cores", "elastic", "expected"),
    [case[1:] for case in REWRITES],
    ids=[case[0] for case in REWRITES],
)
def test_rewrite_pytest(cmd, cores, elastic, expected):
    """pytest commands get -n <cores> when elastic on several cores; others are untouched."""
    assert rewrite_pytest(cmd, cores, elastic) == expected


def test_rewrite_does_not_mutate_its_input():
    """The argv list given to rewrite_pytest is left as it was."""
    cmd = ["pytest", "-n", "4"]
    rewrite_pytest(cmd, 2, True)
    assert cmd == ["pytest", "-n", "4"]


CAPS = [
    ("under limit", [b"abc"], 10, "abc", False),
    ("exact limit", [b"abcde"], 5, "abcde", False),
    ("over limit", [b"abcdefg"], 5, "abcde" + TRUNCATION_MARKER.format(dropped=2), True),
    (
        "over across chunks",
        [b"abc", b"def", b"gh"],
        4,
        "abcd" + TRUNCATION_MARKER.format(dropped=4),
        True,
    ),
    ("zero limit", [b"xy"], 0, TRUNCATION_MARKER.format(dropped=2), True),
    ("bad utf-8 replaced", [b"\xffok"], 10, "\ufffdok", False),
]


@pytest.mark.parametrize(
    ("chunks", "limit", "text", "truncated"), [c[1:] for c in CAPS], ids=[c[0] for c in CAPS]
)
def test_output_buffer(chunks, limit, text, truncated):
    """Streams keep their first `limit` bytes and end with a marker naming the rest."""
    buf = OutputBuffer(limit)
    for chunk in chunks:
        buf.feed(chunk)
    assert (buf.text(), buf.truncated) == (text, truncated)
    capped = agent._Capped(limit)  # the in-container agent caps the same way
    for chunk in chunks:
        capped.feed(chunk)
    assert capped.text() == text
    assert cap_output(b"".join(chunks), limit) == (text, truncated)


def test_agent_and_host_agree_on_the_marker():
    """The agent (stdlib only, no tangramd imports) carries the same truncation marker."""
    assert agent.TRUNCATION_MARKER == TRUNCATION_MARKER


def test_agent_frames_are_length_prefixed_json():
    """Frames are a 4-byte big-endian length and JSON, never pickle."""
    frame = agent.encode_frame({"op": "ping"})
    assert frame[:4] == len(frame[4:]).to_bytes(4, "big")
    assert frame[4:] == b'{"op":"ping"}'
    with pytest.raises(ValueError):
        agent.decode_header((agent.MAX_FRAME + 1).to_bytes(4, "big"))


def test_agent_runs_commands_locally():
    """The agent's runner works on its own: exit code, output, timeout with partial output."""
    ok = agent.run_command({"cmd": "echo hi", "max_output": 100, "cores": None})
    assert (ok["exit_code"], ok["stdout"], ok["timed_out"]) == (0, "hi\n", False)
    slow = agent.run_command({"cmd": "echo a; sleep 20", "max_output": 100, "timeout_s": 0.5})
    assert slow["timed_out"] and slow["stdout"] == "a\n" and slow["exec_s"] < 3


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (3, 3), (-9, 137), (-15, 143)])
def test_signal_deaths_use_shell_convention(returncode, code):
    """A child killed by signal N is reported as exit code 128+N by every backend."""
    assert exit_code_from_returncode(returncode) == code


@pytest.mark.parametrize(
    "kwargs",
    [{"cores": ()}, {"cores": (0, 0)}, {"cores": (-1,)}, {"timeout_s": 0}, {"max_output": -1}],
)
def test_exec_request_validates(kwargs):
    """Malformed requests are refused when built, not when run."""
    base = {"env_id": "e", "cmd": ["true"], "cores": (0,)}
    with pytest.raises(ValueError):
        ExecRequest(**{**base, **kwargs})


def test_confine_real_agrees_with_realpath(tmp_path):
    """confine_real (an lstat per part below a real root, realpath once a part is a link)
    gives what realpath gives, and refuses what leaves the root, links included."""
    base = os.path.realpath(tmp_path / "env")
    os.makedirs(f"{base}/a/b")
    open(f"{base}/f", "w").close()
    links = {"out": "/etc", "in": "a", "root": "/", "abs_in": f"{base}/a", "gone": "missing"}
    for name, target in links.items():
        os.symlink(target, f"{base}/{name}")
    os.symlink("../..", f"{base}/a/up")

    def reference(path: str) -> str:
        resolved = os.path.realpath(os.path.join(base, path))
        if resolved != base and not resolved.startswith(base + "/"):
            return "escape"
        return resolved

    paths = ["main.py", "", ".", "./a", "a/b", "a/b/", "a//b", "a/./b", "f/x", "new/deeper/x",
             "in", "in/b/c", "abs_in/b", "gone", "gone/x", "out", "out/passwd", "root/etc",
             "a/up", "a/up/x", "/etc/passwd", f"{base}/a", base]  # fmt: skip
    for path in paths:
        try:
            got = confine_real(base, path)
        except PathEscape:
            got = "escape"
        assert got == reference(path), path
    for bad in ("..", "a/../b", "a/b/..", "x\0y"):
        with pytest.raises(PathEscape):
            confine_real(base, bad)
