"""tangramctl rendering and exit-code logic, against a tiny in-test fake daemon.

The fake serves canned answers over the real transport (``tangramd.transport.UnixServer``)
so the real client and CLI run end to end; what it answers is chosen per test. Behaviour
of the real daemon is covered by the integration tests.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from tangram.model import Unschedulable
from tangram.protocol import InfraError, NotFound, UnknownOp
from tangramctl.main import cli, leaf_commands
from tangramctl.profile import is_pytest, parse_dops, pytest_counts, verdict
from tangramctl.render import fmt, table
from tangramd.transport import UnixServer

Handler = Callable[[dict[str, Any]], Any]


class FakeDaemon:
    """Serves ``handlers[op](args)`` on a Unix socket from a background event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handlers: dict[str, Handler] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server = UnixServer(path, self._handle, idle_timeout_s=30.0)

    async def _handle(self, op: str, args: dict[str, Any], conn: object) -> Any:
        self.requests.append((op, args))
        handler = self.handlers.get(op)
        if handler is None:
            raise UnknownOp(f"fake daemon has no {op!r}")
        return handler(args)

    def ops(self, name: str) -> list[dict[str, Any]]:
        """Args of every request for op ``name``, in order (an exec's ``ref``, the name
        the client gives each exec so that Ctrl-C can cancel it, left out)."""
        out = []
        for op, args in self.requests:
            if op == name:
                assert op != "exec" or str(args.get("ref", "")).startswith("sync-"), args
                out.append({k: v for k, v in args.items() if not (op == "exec" and k == "ref")})
        return out

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tgctl-", dir="/tmp")  # short: AF_UNIX paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_daemon(sock_dir: str) -> Iterator[FakeDaemon]:
    """A fake daemon on a fresh socket; a test sets its handlers."""
    fake = FakeDaemon(f"{sock_dir}/d.sock")
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def invoke_ctl(path: str, *args: str) -> Result:
    """``tangramctl --socket PATH ARGS...`` in this process, exceptions raised."""
    return CliRunner().invoke(cli, ["--socket", path, *args], catch_exceptions=False)


def exec_result(**overrides: Any) -> dict[str, Any]:
    result = {
        "action_id": "a1",
        "outcome": "ok",
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "queue_s": 0.01,
        "exec_s": 0.5,
        "act_s": 0.51,
        "cores": [0],
        "truncated": False,
    }
    result.update(overrides)
    return result


EXEC_KEYS = {"outcome", "exit_code", "stdout", "stderr", "queue_s", "exec_s", "act_s", "cores"}


# --------------------------------------------------------------------------- unreachable


def test_unreachable_socket_is_one_line_and_exit_2(sock_dir: str) -> None:
    """Without a daemon, commands print one clear line (no traceback) and exit 2."""
    path = f"{sock_dir}/missing.sock"
    result = invoke_ctl(path, "status", "--json")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.strip() == (
        f"tangramctl: cannot reach tangramd at {path}: No such file or directory; "
        "is `tangramd up` running?"
    )
    assert "Traceback" not in result.output


def test_unreachable_socket_for_exec_is_an_infra_error(sock_dir: str) -> None:
    """exec without a daemon exits 125 (its infra-error code) and --json still gives an object."""
    path = f"{sock_dir}/missing.sock"
    result = invoke_ctl(path, "exec", "--json", "--", "true")
    assert result.exit_code == 125
    body = json.loads(result.stdout)
    assert body["outcome"] == "infra_error" and body["exit_code"] is None
    assert set(body) >= EXEC_KEYS
    assert "cannot reach tangramd" in result.stderr


def test_socket_from_environment(sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --socket the path comes from $TANGRAM_SOCKET (and the error names it)."""
    path = f"{sock_dir}/env.sock"
    monkeypatch.setenv("TANGRAM_SOCKET", path)
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 2
    assert f"at {path}:" in result.stderr


# --------------------------------------------------------------------------- --json shapes


def test_status_json_is_the_daemon_answer(fake_daemon: FakeDaemon) -> None:
    """status --json prints exactly the daemon's status map."""
    answer = {"version": "0.1.0", "uptime_s": 1.5, "pools": {"cpu:local": {"free": 2}}}
    fake_daemon.handlers["status"] = lambda args: answer
    result = invoke_ctl(fake_daemon.path, "status", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == answer


@pytest.mark.parametrize(
    ("argv", "op", "key", "rows"),
    [
        (["nodes"], "nodes", "nodes", [{"id": "local", "cores": 2, "free_cores": 1}]),
        (["env", "list"], "env.list", "envs", [{"id": "e1", "mem": 1 << 30}]),
        (["api", "list"], "api.list", "apis", [{"name": "search", "quota": 10}]),
        (["profiles", "list"], "profile.list", "profiles", [{"name": "p", "t1_s": 3.0}]),
    ],
    ids=["nodes", "env-list", "api-list", "profiles-list"],
)
def test_list_commands_json(
    fake_daemon: FakeDaemon, argv: list[str], op: str, key: str, rows: list[dict[str, Any]]
) -> None:
    """List commands print the op's result map ({key: [rows]}) with --json."""
    fake_daemon.handlers[op] = lambda args: {key: rows}
    result = invoke_ctl(fake_daemon.path, *argv, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {key: rows}


def test_env_open_prints_the_id(fake_daemon: FakeDaemon) -> None:
    """env open prints the bare id for scripts, and {"id": …, "node": …} with --json."""
    fake_daemon.handlers["env.open"] = lambda args: {"id": "e42", "node": "n1"}
    plain = invoke_ctl(fake_daemon.path, "env", "open", "--mem", "512MiB")
    assert (plain.exit_code, plain.stdout) == (0, "e42\n")
    assert fake_daemon.ops("env.open")[0] == {"mem": 512 << 20}
    as_json = invoke_ctl(fake_daemon.path, "env", "open", "--image", "img:1", "--json")
    assert json.loads(as_json.stdout) == {"id": "e42", "node": "n1"}
    assert fake_daemon.ops("env.open")[1] == {"image": "img:1"}


def test_env_close_sends_the_id(fake_daemon: FakeDaemon) -> None:
    """env close ID closes that environment and prints nothing without --json."""
    fake_daemon.handlers["env.close"] = lambda args: {}
    result = invoke_ctl(fake_daemon.path, "env", "close", "e7")
    assert (result.exit_code, result.stdout) == (0, "")
    assert fake_daemon.ops("env.close") == [{"id": "e7"}]


# --------------------------------------------------------------------------- exec


def test_exec_json_shape(fake_daemon: FakeDaemon) -> None:
    """exec --json prints one object with the contract's fields and the command's exit code."""
    fake_daemon.handlers["exec"] = lambda args: exec_result(stdout="hi\n", cores=[0, 1])
    result = invoke_ctl(fake_daemon.path, "exec", "--json", "--", "echo", "hi")
    assert result.exit_code == 0
    body = json.loads(result.stdout)
    assert set(body) >= EXEC_KEYS
    assert (body["outcome"], body["stdout"], body["cores"]) == ("ok", "hi\n", [0, 1])


def test_infra_error_detail_reaches_stderr_and_json(fake_daemon: FakeDaemon) -> None:
    """The daemon's reason for an infra_error is printed, and kept in --json."""
    why = "cannot create cpuset cgroup for cores [1]"
    fake_daemon.handlers["exec"] = lambda args: exec_result(
        outcome="infra_error", exit_code=None, detail=why
    )
    result = invoke_ctl(fake_daemon.path, "exec", "--", "cmd")
    assert result.exit_code == 125 and f"infra_error: {why}" in result.stderr
    body = json.loads(invoke_ctl(fake_daemon.path, "exec", "--json", "--", "cmd").stdout)
    assert body["detail"] == why


EXIT_CASES = [
    ("ok", 0, 0),
    ("failed", 3, 3),
    ("failed", -9, 137),
    ("failed", None, 1),
    ("timeout", 143, 124),
    ("infra_error", None, 125),
    ("rejected", None, 2),
]


@pytest.mark.parametrize(
    ("outcome", "exit_code", "expected"), EXIT_CASES, ids=[f"{c[0]}-{c[1]}" for c in EXIT_CASES]
)
def test_exec_exit_codes(
    fake_daemon: FakeDaemon, outcome: str, exit_code: int | None, expected: int
) -> None:
    """exec exits with the command's code, 124 on timeout, 125 when the infra failed, 2 when
    the request was rejected."""
    fake_daemon.handlers["exec"] = lambda args: exec_result(outcome=outcome, exit_code=exit_code)
    assert invoke_ctl(fake_daemon.path, "exec", "--", "cmd").exit_code == expected
    assert invoke_ctl(fake_daemon.path, "exec", "--json", "--", "cmd").exit_code == expected


def test_exec_prints_streams_separately(fake_daemon: FakeDaemon) -> None:
    """The command's stdout goes to stdout and its stderr to stderr, unchanged."""
    fake_daemon.handlers["exec"] = lambda args: exec_result(
        outcome="failed", exit_code=1, stdout="out\nno newline", stderr="err\n"
    )
    result = invoke_ctl(fake_daemon.path, "exec", "--", "cmd")
    assert result.exit_code == 1
    assert result.stdout == "out\nno newline"
    assert result.stderr == "err\n"


def test_exec_sends_the_demand(fake_daemon: FakeDaemon) -> None:
    """exec turns flags into the op's args; everything after -- is the argv, untouched."""
    fake_daemon.handlers["exec"] = lambda args: exec_result()
    argv = ["exec", "--cpus", "2-4", "--mem", "512MiB", "--timeout", "7.5", "--no-elastic"]
    argv += ["--profile", "suite", "--setenv", "A=1=2", "--", "pytest", "-x", "--cpus", "9"]
    assert invoke_ctl(fake_daemon.path, *argv).exit_code == 0
    (args,) = fake_daemon.ops("exec")
    assert args == {
        "cmd": ["pytest", "-x", "--cpus", "9"],
        "cpus": [2, 4],
        "mem": 512 << 20,
        "timeout_s": 7.5,
        "elastic": False,
        "profile": "suite",
        "env_vars": {"A": "1=2"},
    }


def test_exec_in_an_env_and_shell_form(fake_daemon: FakeDaemon) -> None:
    """--env targets an open environment; --shell sends one shell string."""
    fake_daemon.handlers["exec"] = lambda args: exec_result()
    assert (
        invoke_ctl(
            fake_daemon.path, "exec", "--env", "e1", "--shell", "--", "echo", "a", "|", "wc"
        ).exit_code
        == 0
    )
    assert fake_daemon.ops("exec") == [{"cmd": "echo a | wc", "env": "e1"}]


def test_cli_exec_with_a_profile_leaves_the_cores_to_it(fake_daemon: FakeDaemon) -> None:
    """``exec --profile`` without ``--cpus`` sends no core count (the daemon then takes the
    profile's DoP range, or 1 core); an explicit ``--cpus`` is sent as given."""
    fake_daemon.handlers["exec"] = lambda args: exec_result()
    assert invoke_ctl(fake_daemon.path, "exec", "--profile", "suite", "--", "true").exit_code == 0
    assert (
        invoke_ctl(
            fake_daemon.path, "exec", "--cpus", "1", "--profile", "suite", "--", "true"
        ).exit_code
        == 0
    )
    assert fake_daemon.ops("exec") == [
        {"cmd": ["true"], "profile": "suite"},
        {"cmd": ["true"], "cpus": 1, "profile": "suite"},
    ]


def test_client_exec_with_a_profile_leaves_the_cores_to_it(fake_daemon: FakeDaemon) -> None:
    """``Client.exec(profile=...)`` without ``cpus`` sends no core count, so the daemon takes
    the profile's DoP range (the demo's reward runs were pinned to 1 core by a default)."""
    from tangram import Client

    fake_daemon.handlers["exec"] = lambda args: exec_result()
    with Client(fake_daemon.path) as c:
        c.exec("true", profile="suite")
        c.exec("true", cpus=1, profile="suite")
    assert fake_daemon.ops("exec") == [
        {"cmd": "true", "profile": "suite"},
        {"cmd": "true", "cpus": 1, "profile": "suite"},
    ]


@pytest.mark.parametrize("cpus", ["0", "4-2", "x", "1-"])
def test_exec_rejects_bad_cpus(fake_daemon: FakeDaemon, cpus: str) -> None:
    """A malformed --cpus is a usage error before anything is sent."""
    result = invoke_ctl(fake_daemon.path, "exec", "--cpus", cpus, "--", "true")
    assert result.exit_code == 2
    assert "--cpus" in result.stderr
    assert fake_daemon.requests == []


@pytest.mark.parametrize(
    ("error", "outcome", "code"),
    [
        (Unschedulable("demand.cpu: needs 64 cores"), "rejected", 2),
        (InfraError("dockerd down"), "infra_error", 125),
    ],
    ids=["unschedulable", "infra"],
)
def test_exec_refused_by_daemon(
    fake_daemon: FakeDaemon, error: Exception, outcome: str, code: int
) -> None:
    """A refused request exits 2, an infrastructure failure 125; --json still gives an object."""

    def refuse(args: dict[str, Any]) -> Any:
        raise error

    fake_daemon.handlers["exec"] = refuse
    result = invoke_ctl(fake_daemon.path, "exec", "--json", "--", "true")
    assert result.exit_code == code
    body = json.loads(result.stdout)
    assert body["outcome"] == outcome
    assert body["error"]["code"] == error.code  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- human output


def test_refused_request_is_one_line_exit_1(fake_daemon: FakeDaemon) -> None:
    """A typed daemon error prints 'tangramctl: CODE: MESSAGE' and exits 1."""

    def missing(args: dict[str, Any]) -> Any:
        raise NotFound(f"no story for action {args['action_id']!r}")

    fake_daemon.handlers["story"] = missing
    result = invoke_ctl(fake_daemon.path, "story", "a9")
    assert result.exit_code == 1
    assert result.stderr == "tangramctl: not_found: no story for action 'a9'\n"


def test_nodes_table_is_aligned(fake_daemon: FakeDaemon) -> None:
    """Human output is a table: a header row and one aligned row per node; memory once, in
    binary units; the busy cores by id ('none' when all are free, never a bare '-')."""
    fake_daemon.handlers["nodes"] = lambda args: {
        "nodes": [
            {"name": "local", "id": "local", "cores": 2, "free_cores": 2, "busy_cores": [],
             "mem_bytes": 2 << 30, "mem_gb": 2.0},
            {"name": "n2", "id": "n2", "cores": 64, "free_cores": 10,
             "busy_cores": [0, *range(10, 63)], "mem_bytes": 1 << 40, "mem_gb": 1024.0},
        ]
    }  # fmt: skip
    result = invoke_ctl(fake_daemon.path, "nodes")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "CORES", "FREE_CORES", "BUSY_CORES", "MEM"]
    assert lines[1].split() == ["local", "2", "2", "none", "2.0GiB"]
    assert lines[2].split() == ["n2", "64", "10", "0,10-62", "1.0TiB"]
    # numbers right-aligned under their header
    assert lines[1].index("2") + 1 == lines[0].index("CORES") + len("CORES")
    # --json keeps the daemon's rows as they are
    assert json.loads(invoke_ctl(fake_daemon.path, "nodes", "--json").stdout)["nodes"][1][
        "busy_cores"
    ] == [0, *range(10, 63)]


def test_story_renders_events(fake_daemon: FakeDaemon) -> None:
    """story shows the action's summary then its events in order."""
    fake_daemon.handlers["story"] = lambda args: {
        "action_id": "a1",
        "outcome": "ok",
        "events": [
            {"t": 0.1, "event": "submitted", "detail": "cpus=[1, 2]"},
            {"t": 0.2, "event": "finished", "detail": "outcome=ok"},
        ],
    }
    out = invoke_ctl(fake_daemon.path, "story", "a1").stdout
    assert "action_id: a1" in out
    assert out.index("submitted") < out.index("finished")


def test_help_lists_the_commands() -> None:
    """The CLI loads and lists its commands (optional ones may be absent)."""
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ("status", "nodes", "queue", "story", "exec", "env", "api", "profile"):
        assert f"  {name} " in result.stdout


# --------------------------------------------------------------------------- profile


def fake_profiled_daemon(
    fake_daemon: FakeDaemon, cores: int, summary: Callable[[int], str] | None = None
) -> None:
    """Node with ``cores`` cores; exec takes 8/K s at K cores (perfect scaling)."""
    fake_daemon.handlers["nodes"] = lambda args: {"nodes": [{"id": "local", "cores": cores}]}
    fake_daemon.handlers["env.open"] = lambda args: {"id": "e1"}
    fake_daemon.handlers["env.close"] = lambda args: {}
    fake_daemon.handlers["profile.save"] = lambda args: {}

    def execute(args: dict[str, Any]) -> dict[str, Any]:
        k = args["cpus"]
        out = summary(k) if summary else ""
        return exec_result(exec_s=8.0 / k, cores=list(range(k)), stdout=out)

    fake_daemon.handlers["exec"] = execute


def test_profile_json_and_skipped_dops(fake_daemon: FakeDaemon) -> None:
    """profile --json has the contract's fields; DoPs over the node's cores are skipped."""
    fake_profiled_daemon(fake_daemon, cores=4)
    result = invoke_ctl(
        fake_daemon.path, "profile", "--dop", "2,4,8", "--repeat", "2", "--json", "--", "make"
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["dop"] == {"1": 8.0, "2": 4.0, "4": 2.0}
    assert body["t1_s"] == 8.0
    assert body["speedup"] == {"1": 1.0, "2": 2.0, "4": 4.0}
    assert body["eff"] == {"1": 1.0, "2": 1.0, "4": 1.0}
    assert (body["elastic"], body["outcomes_differ"]) == (True, False)
    assert "skipping DoP 8" in result.stderr
    execs = fake_daemon.ops("exec")
    assert [a["cpus"] for a in execs] == [1, 1, 2, 2, 4, 4]
    assert all(a["env"] == "e1" and a["elastic"] is True for a in execs)
    assert all(a["env_vars"] == {"TANGRAM_CPUS": str(a["cpus"])} for a in execs)
    assert fake_daemon.ops("env.close") == [{"id": "e1"}]
    assert fake_daemon.ops("profile.save") == []


def test_profile_outcome_change_marks_non_elastic(fake_daemon: FakeDaemon) -> None:
    """If pytest's counts under -n K differ from -n 1, the profile is not elastic."""

    def summary(k: int) -> str:
        failed = 0 if k == 1 else 1
        return f"===== {10 - failed} passed, {failed} failed in 1.00s =====\n"

    fake_profiled_daemon(fake_daemon, cores=2, summary=summary)
    result = invoke_ctl(
        fake_daemon.path, "profile", "--dop", "1,2", "--repeat", "1", "--json", "--", "pytest", "-q"
    )
    body = json.loads(result.stdout)
    assert (body["elastic"], body["outcomes_differ"]) == (False, True)
    assert "differs from DoP 1 (10 passed, 0 failed, 0 errors)" in result.stderr


def test_profile_save_and_table(fake_daemon: FakeDaemon) -> None:
    """--save stores the measured profile; without --json a table is printed."""
    fake_profiled_daemon(fake_daemon, cores=2)
    result = invoke_ctl(
        fake_daemon.path, "profile", "--dop", "1,2", "--repeat", "1", "--save", "mk", "--", "make"
    )
    assert result.exit_code == 0, result.output
    assert fake_daemon.ops("profile.save") == [
        {
            "name": "mk",
            "dop": {"1": 8.0, "2": 4.0},
            "t1_s": 8.0,
            "eff": {"1": 1.0, "2": 1.0},
            "speedup": {"1": 1.0, "2": 2.0},
            "elastic": True,
        }
    ]
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["DOP", "MEDIAN", "S", "SPEEDUP", "EFF"]
    assert lines[2].split() == ["2", "4.000", "2.000", "1.000"]


def test_profile_infra_error_stops_with_125(fake_daemon: FakeDaemon) -> None:
    """A run the infrastructure could not complete aborts the profile with exit 125."""
    fake_profiled_daemon(fake_daemon, cores=2)
    fake_daemon.handlers["exec"] = lambda args: exec_result(outcome="infra_error", exit_code=None)
    result = invoke_ctl(fake_daemon.path, "profile", "--dop", "1", "--", "make")
    assert result.exit_code == 125
    assert "infra_error" in result.stderr
    assert fake_daemon.ops("env.close") == [{"id": "e1"}]


# --------------------------------------------------------------------------- pure helpers

PYTEST_OUTPUTS = [
    ("=== 3 passed, 1 failed in 2.10s ===", {"passed": 3, "failed": 1, "errors": 0}),
    ("3 passed, 2 skipped in 0.05s", {"passed": 3, "failed": 0, "errors": 0}),
    (
        "== 1 failed, 2 passed, 1 error, 1 warning in 1.2s ==",
        {"passed": 2, "failed": 1, "errors": 1},
    ),
    ("==== no tests ran in 0.01s ====", {"passed": 0, "failed": 0, "errors": 0}),
    ("hello\nworld", None),
]


@pytest.mark.parametrize(("text", "expected"), PYTEST_OUTPUTS, ids=[str(i) for i in range(5)])
def test_pytest_counts(text: str, expected: dict[str, int] | None) -> None:
    """pytest's summary line (with or without rulers) yields passed/failed/error counts."""
    assert pytest_counts("collected 4 items\n" + text + "\n") == expected


def test_is_pytest() -> None:
    """The same pytest spellings the daemon rewrites are recognised."""
    assert is_pytest(["pytest", "-q"]) and is_pytest(["/usr/bin/py.test"])
    assert is_pytest(["python3", "-m", "pytest"]) and is_pytest(["python3.11", "-m", "pytest"])
    assert not is_pytest(["python3", "-c", "pytest"]) and not is_pytest(["make", "test"])


def test_parse_dops_always_measures_one_core() -> None:
    """DoP lists are sorted, deduplicated and include 1 (T1 is the reference)."""
    assert parse_dops("8,2,2,4") == [1, 2, 4, 8]


def test_render_helpers() -> None:
    """Cells: core lists as ranges, byte keys as sizes, floats rounded, empty as '-'."""
    assert fmt([0, 1, 2, 3, 6]) == "0-3,6"
    assert fmt(3 << 30, "mem") == "3.0GiB"
    assert fmt(0.123456) == "0.123"
    assert fmt([]) == "-" and fmt(None) == "-"
    assert table([]) == "(none)"
    assert table([{"a": 1, "b": "x"}], preferred=["b"]).splitlines()[0].split() == ["B", "A"]


def test_version_is_printed() -> None:
    """``tangramctl --version`` names the program and the installed version."""
    from importlib.metadata import version

    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and version("arl-tangram") in result.output


# --------------------------------------------------------------------------- consistency

# Leaf commands without --json, each with the reason (none today: keep it that way).
NO_JSON: dict[tuple[str, ...], str] = {}
# Metavars that say only the type: each option names what it wants (SECONDS, N, PATH, ...).
TYPE_ONLY_METAVARS = {"TEXT", "INTEGER", "FLOAT", "INTEGER RANGE", "FLOAT RANGE"}
WIDE: dict[str, Any] = {"terminal_width": 1000, "max_content_width": 1000}  # help unwrapped


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option)]


def _all_commands() -> list[tuple[str, click.Command]]:
    """Every leaf command of tangramctl and of tangramd, as 'prog sub…'."""
    from tangramd.main import cli as tangramd_cli

    commands = [("tangramctl " + " ".join(path), cmd) for path, cmd in leaf_commands(cli)]
    commands += [("tangramd " + " ".join(p), c) for p, c in leaf_commands(tangramd_cli)]
    return commands


def test_every_tangramctl_command_takes_json() -> None:
    """docs/design.md §6: every command takes --json (or is listed in NO_JSON, with why)."""
    missing = [
        path
        for path, command in leaf_commands(cli)
        if path not in NO_JSON and not any("--json" in o.opts for o in _options(command))
    ]
    assert missing == []
    assert len(leaf_commands(cli)) >= 25  # the walk found the tree (groups included)


def test_every_option_has_help_and_a_telling_metavar() -> None:
    """Every option of every tangramctl and tangramd command says what it is for, and what
    it takes: no bare TEXT/INTEGER/FLOAT metavar; durations are SECONDS."""
    ctx = click.Context(cli)
    no_help, vague, durations = [], [], []
    for where, command in _all_commands():
        for option in _options(command):
            name = f"{where} {option.opts[0]}"
            if not option.help:
                no_help.append(name)
            if option.is_flag:
                continue
            metavar = option.make_metavar(ctx)
            if metavar in TYPE_ONLY_METAVARS:
                vague.append(f"{name} {metavar}")
            is_duration = any(w in (option.name or "") for w in ("timeout", "interval"))
            if is_duration and metavar != "SECONDS":
                durations.append(f"{name} {metavar}")
    assert (no_help, vague, durations) == ([], [], [])


def test_exec_help_lists_every_exit_code() -> None:
    """exec --help names its exit codes: the command's, 2, 124 and 125."""
    text = " ".join(CliRunner().invoke(cli, ["exec", "--help"], **WIDE).stdout.split())
    assert "2 on a usage or request error" in text
    assert "124 on timeout" in text and "125 on an infrastructure error" in text


@pytest.mark.parametrize(
    "argv", [["exec", "--mem", "lots", "--", "true"], ["env", "open", "--mem", "lots"]]
)
def test_a_bad_size_names_the_option_and_the_forms(
    fake_daemon: FakeDaemon, argv: list[str]
) -> None:
    """`--mem lots` is a usage error naming --mem and the sizes it takes; nothing is sent."""
    result = invoke_ctl(fake_daemon.path, *argv)
    assert result.exit_code == 2
    assert "'--mem': 'lots': want bytes or a size such as 512MiB" in result.stderr
    assert fake_daemon.requests == []


def test_socket_may_follow_the_command(fake_daemon: FakeDaemon, sock_dir: str) -> None:
    """`tangramctl status --socket PATH` works as `tangramctl --socket PATH status`; the
    later one wins when both are given."""
    fake_daemon.handlers["status"] = lambda args: {"version": "x"}
    fake_daemon.handlers["node.drain"] = lambda args: {"name": args["name"]}
    result = CliRunner().invoke(cli, ["status", "--json", "--socket", fake_daemon.path])
    assert result.exit_code == 0 and json.loads(result.stdout) == {"version": "x"}
    result = CliRunner().invoke(
        cli,
        ["--socket", f"{sock_dir}/none.sock", "node", "drain", "n1", "--socket", fake_daemon.path],
    )
    assert (result.exit_code, result.stdout) == (0, "node n1 draining\n")
    assert "--socket PATH" in CliRunner().invoke(cli, ["queue", "--help"]).stdout


def test_session_exec_with_one_spaced_word_is_a_shell_line(fake_daemon: FakeDaemon) -> None:
    """`exec --session S -- 'echo $Z'` (the form `session --help` shows) sends a shell line;
    several words, or one without spaces, stay argv; without --session argv is untouched."""
    fake_daemon.handlers["exec"] = lambda args: exec_result()
    invoke_ctl(fake_daemon.path, "exec", "--session", "s1", "--", "echo $Z")
    invoke_ctl(fake_daemon.path, "exec", "--session", "s1", "--", "echo", "$Z")
    invoke_ctl(fake_daemon.path, "exec", "--", "echo $Z")
    assert [a["cmd"] for a in fake_daemon.ops("exec")] == ["echo $Z", ["echo", "$Z"], ["echo $Z"]]
    assert "exec --session ID -- 'CMD LINE'" in " ".join(
        CliRunner().invoke(cli, ["session", "--help"], **WIDE).stdout.split()
    )


def test_session_interrupt_close_and_env_get_print_json(
    fake_daemon: FakeDaemon, tmp_path: Any
) -> None:
    """The commands that printed nothing (or raw bytes) have --json too."""
    fake_daemon.handlers["session.interrupt"] = lambda args: {"interrupted": True}
    fake_daemon.handlers["session.close"] = lambda args: {}
    fake_daemon.handlers["env.get"] = lambda args: {"data": b"abc", "tar": False}
    r = invoke_ctl(fake_daemon.path, "session", "interrupt", "s1", "--json")
    assert json.loads(r.stdout) == {"id": "s1", "interrupted": True}
    r = invoke_ctl(fake_daemon.path, "session", "interrupt", "s1")
    assert r.stdout == "interrupted the command in s1\n"
    r = invoke_ctl(fake_daemon.path, "session", "close", "s1", "--json")
    assert json.loads(r.stdout) == {"id": "s1", "closed": True}
    dest = tmp_path / "f"
    r = invoke_ctl(fake_daemon.path, "env", "get", "e1", "f", "-o", str(dest), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {
        "id": "e1",
        "path": "f",
        "output": str(dest),
        "bytes": 3,
        "tar": False,
    }
    assert dest.read_bytes() == b"abc"
    r = invoke_ctl(fake_daemon.path, "env", "get", "e1", "f", "--json")
    assert r.exit_code == 2 and "--json needs -o DEST" in r.stderr


def test_simulator_policies_are_one_list() -> None:
    """The simulator's --help and its unknown-policy error show the same list, every name
    of which parses."""
    from tangram.sim.policy import POLICIES, PolicyError, parse_policy

    for name in POLICIES:
        parse_policy(name.replace(":K", ":2"))
    help_text = CliRunner().invoke(cli, ["simulate", "--help"], **WIDE).stdout
    assert ", ".join(POLICIES) in help_text
    with pytest.raises(PolicyError, match=re.escape(", ".join(POLICIES))):
        parse_policy("nope")


def test_profile_without_speedup_is_not_elastic(fake_daemon: FakeDaemon) -> None:
    """A profile whose speed-up stays below 1 (0.915 at 2 cores) is not elastic: more cores
    do not pay, so the scheduler would never give them (tangramctl.profile.PAYS)."""
    fake_profiled_daemon(fake_daemon, cores=2)
    fake_daemon.handlers["exec"] = lambda args: exec_result(
        exec_s=8.0 if args["cpus"] == 1 else 8.0 / 0.915, cores=list(range(args["cpus"]))
    )
    argv = ["profile", "--dop", "1,2", "--repeat", "1", "--save", "slow", "--", "make"]
    result = invoke_ctl(fake_daemon.path, *argv)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        "T1 = 8.000 s; not elastic (speed-up 0.92 < 1 at DoP 2: more cores do not pay)"
    )
    assert fake_daemon.ops("profile.save")[0]["elastic"] is False
    assert "not elastic: its execs get one core" in result.stderr
    body = json.loads(invoke_ctl(fake_daemon.path, *argv[:-2], "--json", "--", "make").stdout)
    assert (body["elastic"], body["outcomes_differ"]) == (False, False)


@pytest.mark.parametrize(
    ("speedup", "elastic", "why"),
    [
        ({1: 1.0, 2: 1.8, 4: 2.5}, True, "speed-up 2.50 at DoP 4"),
        ({1: 1.0, 2: 1.0}, False, "speed-up 1.00 <= 1 at DoP 2: more cores do not pay"),
        ({1: 1.0, 2: 0.998}, False, "speed-up 1.00 <= 1 at DoP 2: more cores do not pay"),
        ({1: 1.0}, False, "only DoP 1 measured"),
    ],
)
def test_profile_verdict(speedup: dict[int, float], elastic: bool, why: str) -> None:
    """Elastic iff some DoP > 1 beats DoP 1; the reason names the best one."""
    assert verdict(speedup, outcomes_differ=False) == (elastic, why)
    assert verdict(speedup, outcomes_differ=True) == (False, "outcomes differ across DoPs")
