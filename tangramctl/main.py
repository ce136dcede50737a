"""``tangramctl``: the operators' CLI (docs/design.md §6). Commands stay thin: parse, call, render.

Every command takes ``--json`` (one JSON document on stdout, for programs); without it the
output is for people (aligned tables). Errors are one line on stderr, never a traceback:

- the daemon cannot be reached → exit 2 (``exec``: 125, its infrastructure-error code);
- the daemon refused the request (``not_found``, ``bad_request``, …) → exit 1;
- ``exec`` exits with the command's own exit code; 2 for a usage or request error (a bad
  option, an unknown ``--profile`` or ``--env``, more ``--cpus`` or ``--mem`` than any node
  has, a quota refusal), with one line naming the option; 124 on timeout; 125 only when
  the infrastructure failed (daemon unreachable or shutting down, environment lost, engine
  down); 130 when the action was cancelled (``tangramctl cancel``, by anyone allowed to,
  or Ctrl-C on ``exec``, which cancels it and returns once it is gone);
- ``call`` (one GPU service call) exits 0 ok, 1 failed (the handler rejected the payload),
  124 timeout, 125 infrastructure error, 130 cancelled, 2 usage or request error (unknown
  service, a payload that is not a JSON object, the service removed while the call waited).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, TypeVar

import click

from tangram.client import (
    CallInterrupted,
    CallResult,
    Client,
    ExecInterrupted,
    ExecResult,
    default_socket_path,
)
from tangram.model import TangramError
from tangram.protocol import ConnectionFailed, InfraError, parse_size
from tangram.protocol.ops import MAX_FORK
from tangram.tarsafe import extract_all
from tangramctl.render import NODE_COLUMNS, humanize_sizes, kv, node_rows, table, to_json
from tangramctl.service_profile import service_profile

EXIT_UNREACHABLE = 2
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_INFRA = 125
EXIT_CANCELLED = 130  # as a shell reports a command ended by SIGINT
# Error codes that mean "this request cannot be served as asked" (the caller's to fix),
# as opposed to infrastructure failures.
REQUEST_ERRORS = frozenset(
    {"bad_request", "not_found", "unknown_op", "unschedulable", "quota_exceeded"}
)
# Words in a daemon message → the exec option they come from.
_OPTION_OF = (
    ("timeout", "--timeout"),
    ("profile", "--profile"),
    ("mem:", "--mem"),
    ("environment", "--env"),
    ("image", "--image"),
    ("cpu", "--cpus"),
    ("env_vars", "--setenv"),
)

F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- context


@dataclass
class Ctl:
    """Per-invocation state: the socket path and a lazily connected client."""

    socket: str | None = None
    wait_s: float = 0.0  # --wait: how long the first call waits for the daemon to answer
    _client: Client | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        """The socket the client uses (``--socket``, else ``$TANGRAM_SOCKET``, else default)."""
        return self.socket if self.socket is not None else default_socket_path()

    @property
    def client(self) -> Client:
        """The client; connects on its first call."""
        if self._client is None:
            client = Client(self.path)
            if self.wait_s > 0:
                wait_until_ready(client, self.wait_s)
            self._client = client
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


pass_ctl = click.make_pass_decorator(Ctl)


def wait_until_ready(client: Client, wait_s: float, *, every_s: float = 0.1) -> None:
    """``--wait``: ask ``status`` until the daemon answers (a daemon just started in the
    background; a cluster node: once it has joined its coordinator). Raise
    ConnectionFailed naming the wait and the last reason when it has not within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.status()
            return
        except InfraError as exc:  # no socket yet, or a node not joined yet
            if time.monotonic() >= deadline:
                last = getattr(exc.__cause__, "strerror", None) or exc.message
                raise ConnectionFailed(f"no answer within --wait {wait_s:g} s ({last})") from None
        time.sleep(every_s)


def unreachable_message(path: str, exc: BaseException) -> str:
    """``cannot reach tangramd at PATH: REASON; is `tangramd up` running?``."""
    cause = exc.__cause__
    reason = getattr(cause, "strerror", None) or (
        str(cause) if cause else getattr(exc, "message", str(exc))
    )
    return f"cannot reach tangramd at {path}: {reason}; is `tangramd up` running?"


def fail(message: str, code: int) -> NoReturn:
    """Print ``tangramctl: MESSAGE`` on stderr and exit with ``code``."""
    click.echo(f"tangramctl: {message}", err=True)
    sys.exit(code)


class _Cli(click.Group):
    """The root group: turns client errors into one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConnectionFailed as exc:
            ctl = ctx.find_object(Ctl)
            fail(unreachable_message(ctl.path if ctl else default_socket_path(), exc), 2)
        except TangramError as exc:
            fail(f"{exc.code}: {humanize_sizes(exc.message)}", EXIT_REFUSED)


def json_option(func: F) -> F:
    """``--json``: print one JSON document instead of tables."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")(func)


def emit(as_json: bool, data: Any, human: Callable[[], str]) -> None:
    """Print ``data`` as JSON, or ``human()`` for people."""
    click.echo(to_json(data) if as_json else human())


# --------------------------------------------------------------------------- root


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="arl-tangram")
@click.option(
    "--socket",
    "socket_path",
    metavar="PATH",
    default=None,
    help="tangramd's Unix socket [default: $TANGRAM_SOCKET, else the standard path].",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=0,
    metavar="SECONDS",
    help="Wait up to SECONDS for the daemon to answer (one just started; a node: joined).",
)
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None, wait_s: float) -> None:
    """Operate an ARL-Tangram daemon: inspect queues, run and profile actions."""
    ctl = Ctl(socket_path, wait_s)
    ctx.obj = ctl
    ctx.call_on_close(ctl.close)


@cli.command()
@json_option
@pass_ctl
def status(ctl: Ctl, as_json: bool) -> None:
    """Daemon summary: role, uptime, capacity, usage, counts."""
    result = ctl.client.status()
    emit(as_json, result, lambda: kv(result))


@cli.command()
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between frames (>= 0.05).",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Stop after N frames (default: until q or Ctrl-C).",
)
@json_option
@pass_ctl
def top(ctl: Ctl, interval: float, iterations: int | None, as_json: bool) -> None:
    """Live view of pools, queues, running actions and recent ACT per kind (q quits)."""
    from tangramctl.top import run_top

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the view, not an error
        run_top(ctl.client, interval, iterations, as_json)


@cli.command()
@json_option
@pass_ctl
def nodes(ctl: Ctl, as_json: bool) -> None:
    """Nodes with capacity, free resources and heartbeat age."""
    rows = ctl.client.nodes()
    emit(as_json, {"nodes": rows}, lambda: table(node_rows(rows), preferred=NODE_COLUMNS))


@cli.group()
def node() -> None:
    """Drain, undrain and forget cluster nodes."""


@node.command("drain")
@click.argument("name")
@json_option
@pass_ctl
def node_drain(ctl: Ctl, name: str, as_json: bool) -> None:
    """Stop placing new trajectories on NAME (its environments keep working)."""
    result = ctl.client.node_drain(name)
    emit(as_json, result, lambda: f"node {name} draining")


@node.command("forget")
@click.argument("name")
@json_option
@pass_ctl
def node_forget(ctl: Ctl, name: str, as_json: bool) -> None:
    """Forget NAME's credential, so that a join token may join that name again."""
    result = ctl.client.request("node.forget", {"name": name})
    emit(as_json, result, lambda: f"node {name} forgotten")


@node.command("undrain")
@click.argument("name")
@json_option
@pass_ctl
def node_undrain(ctl: Ctl, name: str, as_json: bool) -> None:
    """Place new trajectories on NAME again."""
    result = ctl.client.node_undrain(name)
    emit(as_json, result, lambda: f"node {name} ready")


@cli.group()
def cluster() -> None:
    """Cluster membership (ask the coordinator's socket)."""


@cluster.command("join")
@click.option("--rotate", is_flag=True, help="Replace the join token; joined nodes stay.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="Write the token to PATH (mode 0600) and print a command that reads it from there.",
)
@json_option
@pass_ctl
def cluster_join(ctl: Ctl, rotate: bool, token_file: str | None, as_json: bool) -> None:
    """Print the command a new host runs to join this cluster. The token never goes on
    that command's command line (which `ps` shows every local user): it is passed in
    $TANGRAM_JOIN_TOKEN, or with --token-file in a file only its owner reads."""
    info = ctl.client.cluster_join(rotate=rotate)
    where = f"--coordinator {info['coordinator']}"
    pin = f"--ca-sha256 {info['ca_sha256']}" if info["ca_sha256"] else "--insecure"
    if token_file is not None:
        path = os.path.abspath(token_file)
        try:
            _write_private(path, f"{info['token']}\n")
        except OSError as exc:
            fail(f"--token-file {path}: {exc.strerror or exc}", EXIT_USAGE)
        line = f"tangramd node {where} --token-file {shlex.quote(path)} {pin}"
    else:
        line = f"TANGRAM_JOIN_TOKEN={info['token']} tangramd node {where} {pin}"
    emit(as_json, info, lambda: line)


def _write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (a link there is refused)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode otherwise
        f.write(text)


@cli.command()
@json_option
@pass_ctl
def queue(ctl: Ctl, as_json: bool) -> None:
    """Waiting and running actions, and environments waiting for memory (with what each
    waits for: cores, memory and how much, its environment)."""
    result = ctl.client.queue()
    preferred = (
        "action_id",
        "env_id",
        "kind",
        "state",
        "waiting_for",
        "trajectory",
        "pool",
        "node",
        "waiting_s",
        "deadline_s",
    )

    def human() -> str:
        lists = {k: v for k, v in result.items() if isinstance(v, list)}
        rest = {k: v for k, v in result.items() if k not in lists}
        blocks = [
            f"{name} ({len(rows)}):\n" + table(rows, preferred=preferred)
            for name, rows in lists.items()
        ]
        if rest:
            blocks.append(kv(rest))
        return "\n\n".join(blocks) or "(empty)"

    emit(as_json, result, human)


@cli.command()
@click.argument("action_id", metavar="ID")
@json_option
@pass_ctl
def story(ctl: Ctl, action_id: str, as_json: bool) -> None:
    """What happened to one record, by id: an action (submission, environment, queue,
    placement, run, outcome), a lease, an environment or a session, each transition with
    its time in seconds since the daemon started and the id of the event that caused it."""
    result = ctl.client.story(action_id)

    def human() -> str:
        events = result.get("events") or []
        head = kv({k: v for k, v in result.items() if k != "events"})
        preferred = ("t", "event", "from", "cause", "detail")  # the long one last, whole
        body = table(events, preferred=preferred, empty="(no events)", uncut=("detail",))
        return head + "\n\n" + body

    emit(as_json, result, human)


# --------------------------------------------------------------------------- exec


def parse_cpus(text: str) -> int | tuple[int, int]:
    """``"4"`` → 4; ``"2-8"`` → (2, 8); raise click.BadParameter otherwise."""
    lo, sep, hi = text.partition("-")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise click.BadParameter(f"{text!r}: want N or MIN-MAX, e.g. 4 or 2-8") from None
    if low < 1 or high < low:
        raise click.BadParameter(f"{text!r}: want 1 <= MIN <= MAX")
    return (low, high) if sep else low


def parse_mem(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``--mem``: bytes from ``512MiB``, ``2G``, ``1.5GiB`` or a plain number of bytes;
    click.BadParameter (naming the option and the allowed forms) otherwise."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except TangramError:
        raise click.BadParameter(f"{value!r}: {SIZE_FORMS}") from None


SIZE_FORMS = "want bytes or a size such as 512MiB, 2G or 1.5GiB (K, M, G, T, P; binary)"


def parse_assignments(values: Sequence[str], what: str) -> dict[str, str]:
    """``["A=1", "B=x"]`` → ``{"A": "1", "B": "x"}``; raise click.BadParameter."""
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: want KEY=VALUE", param_hint=what)
        out[key] = value
    return out


def exit_code_for(result: ExecResult) -> int:
    """The CLI's exit status for an exec result (docs/design.md §6 contract)."""
    if result.outcome == "timeout":
        return EXIT_TIMEOUT
    if result.outcome == "rejected":  # the request cannot be served as asked
        return EXIT_USAGE
    if result.outcome == "infra_error":
        return EXIT_INFRA
    if result.outcome == "cancelled":
        return EXIT_CANCELLED
    code = result.exit_code
    if code is None:
        return 0 if result.outcome == "ok" else 1
    if code < 0:  # killed by signal -code, as a shell reports it
        return min(128 - code, 255)
    if result.outcome == "failed" and code == 0:
        return 1
    return min(code, 255)


def option_named(message: str) -> str | None:
    """The ``exec`` option a daemon error message is about, if it says."""
    lowered = message.lower()
    return next((opt for word, opt in _OPTION_OF if word in lowered), None)


def request_error_line(exc: TangramError) -> str:
    """``--cpus: needs at least 3, the largest node has 2`` (sizes in GiB/MiB)."""
    option = option_named(exc.message)
    text = humanize_sizes(exc.message)
    return f"{option}: {text}" if option else f"{exc.code}: {text}"


def _refused_result(exc: TangramError) -> dict[str, Any]:
    """The ``exec --json`` object when the daemon did not run the command at all."""
    outcome = "rejected" if exc.code in ("unschedulable", "quota_exceeded") else "infra_error"
    return {
        "action_id": None,
        "outcome": outcome,
        "exit_code": None,
        "stdout": "",
        "stderr": "",
        "queue_s": 0.0,
        "exec_s": 0.0,
        "act_s": 0.0,
        "cores": [],
        "truncated": False,
        "error": {"code": exc.code, "message": exc.message},
    }


@cli.command(
    "exec",
    short_help="Run one command as an exec action.",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
@click.option("--env", "env_id", metavar="ID", help="Run in this open environment.")
@click.option("--image", metavar="IMG", help="Image of the throwaway environment.")
@click.option(
    "--cpus",
    metavar="N|MIN-MAX",
    callback=lambda ctx, param, value: None if value is None else parse_cpus(value),
    help="Cores: fixed or a range (default: 1, or the DoP range of an elastic --profile).",
)
@click.option("--mem", metavar="SIZE", callback=parse_mem, help="Memory limit, e.g. 512MiB.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Wall-clock limit of the whole action, waiting (cores, memory) plus running (> 0).",
)
@click.option(
    "--queue-timeout",
    "queue_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Limit of the wait alone (> 0); --timeout then bounds the run alone.",
)
@click.option("--profile", metavar="NAME", help="Stored elasticity profile to schedule by.")
@click.option(
    "--elastic/--no-elastic",
    default=None,
    help="Let the scheduler pick the core count in a range (and rewrite pytest to -n).",
)
@click.option("--task", metavar="NAME", help="Task name (key of the duration history).")
@click.option(
    "--job",
    metavar="NAME",
    help="The job it belongs to (fair share across jobs) [default: $TANGRAM_JOB, else 'default'].",
)
@click.option(
    "--api",
    metavar="NAME",
    help="An [[api]] the command calls: it holds one of its slots while it runs, taken "
    "with its cores (it waits until both are free).",
)
@click.option(
    "--setenv",
    "--env-var",
    "setenv",
    multiple=True,
    metavar="KEY=VALUE",
    help="Environment variable.",
)
@click.option("--cwd", metavar="DIR", help="Working directory inside the environment.")
@click.option(
    "--stdin",
    "stdin_file",
    type=click.File("rb"),
    metavar="FILE",
    help="Feed FILE to the command's stdin ('-': this process's stdin).",
)
@click.option(
    "--session",
    metavar="ID",
    help="Run in this open shell session (one CMD word with spaces is a shell line).",
)
@click.option("--shell", is_flag=True, help="Run CMD… joined by spaces through /bin/sh.")
@json_option
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctl
def exec_(
    ctl: Ctl,
    env_id: str | None,
    image: str | None,
    cpus: int | tuple[int, int] | None,
    mem: int | None,
    timeout_s: float | None,
    queue_timeout_s: float | None,
    profile: str | None,
    elastic: bool | None,
    task: str | None,
    job: str | None,
    api: str | None,
    setenv: tuple[str, ...],
    cwd: str | None,
    stdin_file: Any,
    session: str | None,
    shell: bool,
    as_json: bool,
    cmd: tuple[str, ...],
) -> None:
    """Run one command as an exec action: tangramctl exec [OPTIONS] -- CMD [ARG…].

    Without --env it runs in a throwaway environment. With --session, a single CMD word
    that holds spaces ('echo $HOME') is a line for the session's shell, as with `session
    run`. Prints the command's stdout and stderr and exits with its exit code; 2 on a usage
    or request error (a bad option, an unknown --profile or --env, more --cpus or --mem
    than any node has), 124 on timeout, 125 on an infrastructure error, 130 when the
    action was cancelled (`tangramctl cancel ID`), with a line saying so.

    --timeout bounds waiting plus running; a wait past it (or past --queue-timeout) ends
    with 124 and a line naming what it waited for ("waited 2.0 s for memory: needs 1
    GiB, 0.3 GiB free"). Ctrl-C cancels the action, waiting or running (killed with
    everything it started; tangramctl returns once it is gone), and exits 130.
    """
    if env_id is not None and image is not None:
        raise click.UsageError("--env and --image exclude each other (an env has its image)")
    env_vars = parse_assignments(setenv, "--setenv") or None
    try:
        result = ctl.client.exec(
            command_of(cmd, shell, session),
            env=env_id,
            image=image,
            cpus=cpus,
            mem=mem,
            timeout_s=timeout_s,
            queue_timeout_s=queue_timeout_s,
            profile=profile,
            elastic=elastic,
            task=task,
            job=job,
            api=api,
            env_vars=env_vars,
            stdin=stdin_file.read() if stdin_file is not None else None,
            cwd=cwd,
            session=session,
        )
    except ExecInterrupted as exc:  # Ctrl-C: the client cancelled the action
        finish_interrupted(exc, as_json, job=job or ctl.client.job or "default")
    except ConnectionFailed as exc:
        message = unreachable_message(ctl.path, exc)
        if as_json:
            click.echo(to_json(_refused_result(ConnectionFailed(message))))
        fail(message, EXIT_INFRA)
    except TangramError as exc:
        if as_json:
            click.echo(to_json(_refused_result(exc)))
        if exc.code in REQUEST_ERRORS:
            fail(request_error_line(exc), EXIT_USAGE)
        fail(f"{exc.code}: {humanize_sizes(exc.message)}", EXIT_INFRA)
    finish_exec(result, as_json, job=job or ctl.client.job or "default")


def command_of(cmd: Sequence[str], shell: bool, session: str | None) -> str | list[str]:
    """What ``exec`` sends: a shell line for ``--shell``, or for ``--session`` with one word
    that holds whitespace (``'echo $Z'``, the form ``session --help`` shows); else argv."""
    if shell or (session is not None and len(cmd) == 1 and any(c.isspace() for c in cmd[0])):
        return " ".join(cmd)
    return list(cmd)


def finish_interrupted(exc: ExecInterrupted, as_json: bool, job: str | None = None) -> NoReturn:
    """Ctrl-C on ``exec``: the client cancelled the action and it has ended. Report how
    (exit 130 when it was cancelled; its own status when it had ended before)."""
    result = exc.result
    if result is None:  # its answer could not be read (a second Ctrl-C)
        result = ExecResult("cancelled", detail="interrupted (Ctrl-C); its answer was not read")
    elif result.outcome == "cancelled":
        why = f"interrupted (Ctrl-C): {result.detail}" if result.detail else "interrupted (Ctrl-C)"
        result = replace(result, detail=why)
    finish_exec(result, as_json, job=job)


def finish_exec(result: ExecResult, as_json: bool, job: str | None = None) -> NoReturn:
    """Print an exec's result (its output, or its JSON: with ``job``, the job it ran under)
    with one line saying why it did not complete, if it did not; exit with the exec
    contract's status."""
    if as_json:
        click.echo(to_json({**result.to_wire(), **({"job": job} if job else {})}))
    else:
        click.echo(result.stdout, nl=False)
        click.echo(result.stderr, nl=False, err=True)
        if result.truncated:
            click.echo("tangramctl: output truncated by the daemon", err=True)
        if result.outcome == "timeout" and result.detail.startswith("waited "):
            click.echo(f"tangramctl: timed out before it ran: {result.detail}", err=True)
        elif result.outcome == "timeout":
            click.echo(f"tangramctl: timed out after {result.exec_s:.3g} s", err=True)
        elif result.outcome in ("infra_error", "rejected"):
            why = result.detail or "the command did not complete"
            click.echo(f"tangramctl: {result.outcome}: {why}", err=True)
        elif result.outcome == "cancelled":
            why = result.detail or "cancelled"
            click.echo(f"tangramctl: cancelled: action {result.action_id}: {why}", err=True)
    sys.exit(exit_code_for(result))


@cli.command("cancel")
@click.argument("action_id", metavar="[ID]", required=False)
@click.option("--job", metavar="NAME", help="With --all: cancel the actions of job NAME.")
@click.option(
    "--all",
    "all_",
    is_flag=True,
    help="Every queued and running action of --job (yours; an operator's: everyone's).",
)
@json_option
@pass_ctl
def cancel(ctl: Ctl, action_id: str | None, job: str | None, all_: bool, as_json: bool) -> None:
    """Cancel an exec or call by its action id (see `tangramctl queue`): a waiting one never
    runs; a running exec is killed with everything it started, and this returns once it is
    gone; a running GPU call is stopped (its replica's workers killed, the next call
    restarts it; a batch's rider is detached, its leader's whole pass stopped), and this
    returns once it has ended. Its client gets outcome cancelled (`tangramctl exec` exits
    130). An action that already ended prints its outcome. Exit 0 then too; 1 if there is
    no such action of yours.

    `cancel --job NAME --all` cancels every queued and running exec and call of job NAME
    that you may see (an operator: all of them; others: their own) in one step, and
    returns once the running ones are gone; --json lists each: `{"job", "actions":
    [{"action_id", "cancelled", "state", "outcome"}]}`. Leases are not cancelled (they
    are given back with `tangramctl lease release`)."""
    if all_ and action_id is not None:
        raise click.UsageError("--all cancels a job's actions: give --job NAME --all, not an ID")
    if all_ and job is None:
        raise click.UsageError("--all needs --job NAME (the job whose actions to cancel)")
    if job is not None and not all_:
        raise click.UsageError(f"--job {job} needs --all (cancel every action of the job)")
    if job is not None:
        answer = ctl.client.cancel_job(job)
        rows = answer.get("actions") or []

        def lines() -> str:
            if not rows:
                return f"job {job}: nothing to cancel"
            return "\n".join(_cancel_line(row["action_id"], row) for row in rows)

        emit(as_json, answer, lines)
        return
    if action_id is None:
        raise click.UsageError("give an action ID, or --job NAME --all")
    result = ctl.client.cancel(action_id)
    emit(as_json, result, lambda: _cancel_line(action_id, result))


def _cancel_line(action_id: str, result: dict[str, Any]) -> str:
    """``a5: cancelled`` (or why not) for one action of a cancel's answer."""
    if result.get("state") == "running":
        return f"{action_id}: still running"
    if result.get("cancelled"):
        return f"{action_id}: cancelled"
    return f"{action_id}: already ended ({result.get('outcome')})"


# --------------------------------------------------------------------------- env


@cli.group()
def env() -> None:
    """Open, close and list environments (sandboxes that persist between actions)."""


@env.command("open")
@click.option("--image", metavar="IMG", help="Container image (docker backend).")
@click.option(
    "--mem", metavar="SIZE", callback=parse_mem, help="Memory reserved for the environment's life."
)
@click.option("--trajectory", metavar="NAME", help="Trajectory the environment belongs to.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Most seconds to wait for memory (> 0); past it exit 124 naming what it needed.",
)
@json_option
@pass_ctl
def env_open(
    ctl: Ctl,
    image: str | None,
    mem: int | None,
    trajectory: str | None,
    timeout_s: float | None,
    as_json: bool,
) -> None:
    """Open an environment and print its id (``--json``: its id and node)."""
    args = {"image": image, "mem": mem, "trajectory": trajectory, "timeout_s": timeout_s}
    try:
        opened = ctl.client.request("env.open", {k: v for k, v in args.items() if v is not None})
    except TangramError as exc:
        if exc.code != "timeout":
            raise
        fail(f"{exc.code}: {humanize_sizes(exc.message)}", EXIT_TIMEOUT)
    click.echo(
        to_json({"id": opened["id"], "node": opened.get("node")}) if as_json else opened["id"]
    )


@env.command("close")
@click.argument("env_id", metavar="ID")
@json_option
@pass_ctl
def env_close(ctl: Ctl, env_id: str, as_json: bool) -> None:
    """Close an environment and free its resources."""
    ctl.client.env_close(env_id)
    if as_json:
        click.echo(to_json({"id": env_id, "closed": True}))


@env.command("fork")
@click.argument("env_id", metavar="ID")
@click.option(
    "-n",
    "n",
    type=click.IntRange(1, MAX_FORK),
    metavar="G",
    default=1,
    show_default=True,
    help=f"How many children (1 to {MAX_FORK}).",
)
@json_option
@pass_ctl
def env_fork(ctl: Ctl, env_id: str, n: int, as_json: bool) -> None:
    """Fork an environment: N new ones from a copy-on-write snapshot of its files (one id a
    line; ``--json``: ``{"ids": [...], "fork_s": S}``)."""
    forked = ctl.client.request("env.fork", {"env": env_id, "n": n})
    if as_json:
        click.echo(to_json({"ids": forked["ids"], "fork_s": forked["fork_s"]}))
    else:
        click.echo("\n".join(forked["ids"]))


@env.command("reset")
@click.argument("env_id", metavar="ID")
@json_option
@pass_ctl
def env_reset(ctl: Ctl, env_id: str, as_json: bool) -> None:
    """Put an environment's files back as at its fork point (or its opening)."""
    ctl.client.env_reset(env_id)
    if as_json:
        click.echo(to_json({"id": env_id, "reset": True}))


@env.command("list")
@json_option
@pass_ctl
def env_list(ctl: Ctl, as_json: bool) -> None:
    """Open environments."""
    rows = ctl.client.env_list()
    preferred = ("id", "image", "node", "mem", "trajectory", "state", "idle_s", "actions")
    emit(as_json, {"envs": rows}, lambda: table(rows, preferred=preferred))


@env.command("put")
@click.argument("env_id", metavar="ID")
@click.argument("src", type=click.Path(exists=True))
@click.argument("dest")
@json_option
@pass_ctl
def env_put(ctl: Ctl, env_id: str, src: str, dest: str, as_json: bool) -> None:
    """Copy the local file or directory SRC to DEST inside environment ID."""
    if os.path.isdir(src):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as archive:
            for name in sorted(os.listdir(src)):
                archive.add(os.path.join(src, name), arcname=name)
        sent = ctl.client.put(env_id, dest, buf.getvalue(), tar=True)
    else:
        with open(src, "rb") as f:
            sent = ctl.client.put(env_id, dest, f.read())
    if as_json:
        click.echo(to_json({"id": env_id, "path": dest, "bytes": sent}))


@env.command("get")
@click.argument("env_id", metavar="ID")
@click.argument("path")
@click.option(
    "-o",
    "--output",
    metavar="DEST",
    help="Write the file to DEST (a directory is extracted into DEST); default: stdout.",
)
@json_option
@pass_ctl
def env_get(ctl: Ctl, env_id: str, path: str, output: str | None, as_json: bool) -> None:
    """Copy PATH out of environment ID (a directory comes as a tar stream on stdout).

    With --json (which needs -o: stdout carries the JSON), print what was written where."""
    if as_json and output is None:
        raise click.UsageError("--json needs -o DEST (without it the file's bytes go to stdout)")
    data, is_tar = ctl.client.get(env_id, path)
    if as_json:
        done = {"id": env_id, "path": path, "output": output, "bytes": len(data), "tar": is_tar}
        click.echo(to_json(done))
    if output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    elif is_tar:
        os.makedirs(output, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            extract_all(archive, output)
    else:
        with open(output, "wb") as f:
            f.write(data)


# --------------------------------------------------------------------------- sessions


@cli.group()
def session() -> None:
    """Persistent shell sessions: `session open ENV`, then `session run ID -- CMD…` (or
    `exec --session ID -- 'CMD LINE'`: one quoted word is a line for the shell)."""


@session.command("open")
@click.argument("env_id", metavar="ENV")
@json_option
@pass_ctl
def session_open(ctl: Ctl, env_id: str, as_json: bool) -> None:
    """Start a shell in environment ENV and print the session id."""
    sid = ctl.client.session_open(env_id)
    click.echo(to_json({"id": sid, "env": env_id}) if as_json else sid)


@session.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("session_id", metavar="ID")
@click.option(
    "--cpus",
    default="1",
    metavar="N|MIN-MAX",
    callback=lambda ctx, param, value: parse_cpus(value),
    help="Cores for this command.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Wall-clock limit (> 0).",
)
@json_option
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctl
def session_run(
    ctl: Ctl,
    session_id: str,
    cpus: int | tuple[int, int],
    timeout_s: float | None,
    as_json: bool,
    cmd: tuple[str, ...],
) -> None:
    """Run CMD… (joined by spaces) in the session's shell; exit with its status, as `exec`
    does (a timeout is 124, a shell that is gone an infra_error, each with a line saying so)."""
    try:
        result = ctl.client.exec(" ".join(cmd), session=session_id, cpus=cpus, timeout_s=timeout_s)
    except ExecInterrupted as exc:  # Ctrl-C: the command was interrupted in its shell
        finish_interrupted(exc, as_json)
    finish_exec(result, as_json)


@session.command("interrupt")
@click.argument("session_id", metavar="ID")
@json_option
@pass_ctl
def session_interrupt(ctl: Ctl, session_id: str, as_json: bool) -> None:
    """Interrupt the command running in the session (says whether one was running)."""
    hit = ctl.client.session_interrupt(session_id)
    said = f"interrupted the command in {session_id}" if hit else f"{session_id}: nothing running"
    emit(as_json, {"id": session_id, "interrupted": hit}, lambda: said)


@session.command("close")
@click.argument("session_id", metavar="ID")
@json_option
@pass_ctl
def session_close(ctl: Ctl, session_id: str, as_json: bool) -> None:
    """End the session's shell."""
    ctl.client.session_close(session_id)
    if as_json:
        click.echo(to_json({"id": session_id, "closed": True}))


# --------------------------------------------------------------------------- apis


@cli.group()
def api() -> None:
    """Rate-limited API endpoints."""


@api.command("list")
@json_option
@pass_ctl
def api_list(ctl: Ctl, as_json: bool) -> None:
    """API endpoints with their limits and usage."""
    rows = ctl.client.api_list()
    preferred = ("name", "concurrency", "in_use", "quota", "period_s", "used", "waiting")
    emit(as_json, {"apis": rows}, lambda: table(rows, preferred=preferred))


# --------------------------------------------------------------------------- leases


@cli.group()
def lease() -> None:
    """API leases a program holds (`Client.lease`): renew or give one back by its id (see
    `tangramctl story ID`). There is no `lease acquire` here: a lease is released when its
    holder's connection closes, so one taken by this command would end with it."""


@lease.command("renew")
@click.argument("lease_id", metavar="LEASE_ID")
@click.option(
    "--ttl",
    "ttl_s",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    metavar="SECONDS",
    help="Its new time to live, from now (> 0).",
)
@json_option
@pass_ctl
def lease_renew(ctl: Ctl, lease_id: str, ttl_s: float, as_json: bool) -> None:
    """Extend a lease: it now expires SECONDS from now (a waiting one holds for SECONDS once
    granted). Exit 1 if it was released or has expired."""
    result = ctl.client.lease_renew(lease_id, ttl_s)
    emit(as_json, result, lambda: f"{lease_id}: {result['state']}, expires in {ttl_s:g} s")


@lease.command("release")
@click.argument("lease_id", metavar="LEASE_ID")
@json_option
@pass_ctl
def lease_release(ctl: Ctl, lease_id: str, as_json: bool) -> None:
    """Give a lease back now (its API slot goes to the next waiting one), or withdraw one
    still waiting for its slot. Exit 1 if there is no such lease."""
    answer = ctl.client.request("lease.release", {"lease_id": lease_id})
    released, state = bool(answer.get("released")), str(answer.get("state"))
    said = f"{lease_id}: {state}" if released else f"{lease_id}: {state}, nothing released"
    emit(as_json, {"lease_id": lease_id, "released": released, "state": state}, lambda: said)


# --------------------------------------------------------------------------- jobs


@cli.command("jobs")
@json_option
@pass_ctl
def jobs_cmd(ctl: Ctl, as_json: bool) -> None:
    """Jobs: weight, priority, queued, running and ended actions, cores and GPUs held, share,
    ACT (ended actions and ACTs are kept across daemon restarts)."""
    rows = ctl.client.jobs()
    preferred = (
        "name",
        "weight",
        "priority",
        "queued",
        "running",
        "cores",
        "gpus",
        "share",
        "done",
        "act_p50",
        "act_p99",
    )
    emit(as_json, {"jobs": rows}, lambda: table(rows, preferred=preferred))


# --------------------------------------------------------------------------- stored profiles


@cli.group()
def profiles() -> None:
    """Stored elasticity profiles (measure one with `tangramctl profile`)."""


@profiles.command("list")
@json_option
@pass_ctl
def profiles_list(ctl: Ctl, as_json: bool) -> None:
    """Stored profiles."""
    rows = ctl.client.profile_list()
    preferred = ("name", "t1_s", "elastic", "dop", "eff", "speedup")
    emit(as_json, {"profiles": rows}, lambda: table(rows, preferred=preferred))


@profiles.command("show")
@click.argument("name")
@json_option
@pass_ctl
def profiles_show(ctl: Ctl, name: str, as_json: bool) -> None:
    """One stored profile."""
    result = ctl.client.profile_get(name)
    emit(as_json, result, lambda: kv(result))


# --------------------------------------------------------------------------- GPU services


def parse_gpus(text: str) -> int | list[int]:
    """``"2"`` → 2; ``"1,2,4"`` → [1, 2, 4] (GPUs per instance); raise click.BadParameter."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: want N or a list like 1,2,4") from None
    return counts[0] if len(counts) == 1 else counts


@cli.group()
def service() -> None:
    """GPU model services: register, list, profile, remove (call one with `tangramctl call`)."""


@service.command("register")
@click.argument("name")
@click.option(
    "--runtime",
    type=click.Choice(["torch", "http"]),
    default="torch",
    show_default=True,
    help="torch: a module in a GPU worker; http: a server process (vLLM, SGLang, …).",
)
@click.option("--entry", metavar="MODULE:FACTORY", help="torch: FACTORY() returns the module.")
@click.option(
    "--path",
    "path_dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="torch: directory added to the worker's import path.",
)
@click.option(
    "--mem-gb",
    "mem_gb",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    metavar="GB",
    help="State of one instance (GB, > 0).",
)
@click.option(
    "--gpus",
    default="1",
    show_default=True,
    metavar="N|N,N,…",
    callback=lambda ctx, param, value: parse_gpus(value),
    help="GPUs per instance, or the allowed counts (1, 2, 4, 8).",
)
@click.option("--cmd", metavar="CMDLINE", help="http: server command with {port}.")
@click.option("--route", metavar="PATH", help="http: path calls are POSTed to.")
@click.option("--api", "api_kind", type=click.Choice(["vllm", "sglang"]), help="http: sleep API.")
@click.option("--setenv", multiple=True, metavar="KEY=VALUE", help="Environment variable.")
@click.option("--eff", metavar="N:S,…", help="Speed-up per GPU count, e.g. 1:1,2:1.8,4:3.2.")
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    metavar="B",
    help="Merge up to B concurrent calls into one forward pass (handle_batch) [1].",
)
@click.option(
    "--batch-window-ms",
    type=click.FloatRange(min=0),
    metavar="MS",
    help="How long a batch may wait for more calls before it runs [0].",
)
@click.option(
    "--min-resident",
    type=click.IntRange(min=0),
    metavar="N",
    help="Keep N replicas on GPUs when there is room [0].",
)
@json_option
@pass_ctl
def service_register(
    ctl: Ctl,
    name: str,
    runtime: str,
    entry: str | None,
    path_dir: str | None,
    mem_gb: float,
    gpus: int | list[int],
    cmd: str | None,
    route: str | None,
    api_kind: str | None,
    setenv: tuple[str, ...],
    eff: str | None,
    max_batch: int | None,
    batch_window_ms: float | None,
    min_resident: int | None,
    as_json: bool,
) -> None:
    """Register a service and load it (persists across daemon restarts)."""
    info = ctl.client.service_register(
        name,
        runtime=runtime,
        entry=entry,
        path=os.path.abspath(path_dir) if path_dir else None,
        mem_gb=mem_gb,
        gpus=gpus,
        cmd=cmd,
        route=route,
        api=api_kind,
        env=parse_assignments(setenv, "--setenv") or None,
        eff=eff,
        max_batch=max_batch,
        batch_window_ms=batch_window_ms,
        min_resident=min_resident,
    )
    emit(as_json, info, lambda: kv(info))


@service.command("list")
@json_option
@pass_ctl
def service_list(ctl: Ctl, as_json: bool) -> None:
    """Registered services, their replicas and restores."""
    rows = ctl.client.service_list()

    def human() -> str:
        flat = [
            {
                **{k: row.get(k) for k in ("name", "runtime", "mem_gb", "gpus", "calls")},
                "eff": row.get("eff") or "-",
                "warm": f"{row.get('warm', 0)}/{row.get('min_resident', 0)}",
                "batched": f"{row.get('batched_calls', 0)}/{row.get('batches', 0)}",
                "restores": row.get("restores"),
                "restore_s": round(row.get("restore_s_total") or 0.0, 3),
                "replicas": " ".join(
                    f"{r['state']}@{','.join(map(str, r['gpus'])) or '-'}"
                    for r in row.get("replicas", [])
                ),
                "waiting": row.get("waiting", 0),
            }
            for row in rows
        ]
        return table(flat) if flat else "no services"

    emit(as_json, {"services": rows}, human)


service.add_command(service_profile, "profile")


@service.command("remove")
@click.argument("name")
@json_option
@pass_ctl
def service_remove(ctl: Ctl, name: str, as_json: bool) -> None:
    """Remove a service; its queued calls end rejected."""
    result = ctl.client.service_remove(name)
    rejected = result.get("rejected", 0)
    emit(as_json, result, lambda: f"removed {name} ({rejected} queued call(s) rejected)")


def call_exit_code(result: CallResult) -> int:
    """0 ok, 1 failed, 124 timeout, 125 infra_error, 130 cancelled, 2 rejected (as for
    exec)."""
    codes = {
        "ok": 0,
        "failed": 1,
        "timeout": EXIT_TIMEOUT,
        "infra_error": EXIT_INFRA,
        "cancelled": EXIT_CANCELLED,
    }
    return codes.get(result.outcome, EXIT_USAGE)


@cli.command("call", short_help="Call a GPU service as one action.")
@click.argument("name")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Limit of the handler's run (> 0).",
)
@click.option(
    "--job",
    metavar="NAME",
    help="The job it belongs to (fair share across jobs) [default: $TANGRAM_JOB, else 'default'].",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    metavar="K",
    help="Run at exactly K GPUs [default: the scheduler picks, by the service's eff].",
)
@json_option
@click.argument("payload", metavar="-- PAYLOAD_JSON")
@pass_ctl
def call(
    ctl: Ctl,
    name: str,
    timeout_s: float | None,
    job: str | None,
    gpus: int | None,
    as_json: bool,
    payload: str,
) -> None:
    """Call service NAME with a JSON object: tangramctl call NAME -- '{"x": 1}'.

    Prints the handler's answer as JSON (with --json: outcome, result, error, queue_s,
    restore_s, exec_s, act_s, gpus, node, action_id, batch, job). Exit 0 ok, 1 failed,
    124 timeout, 125 infrastructure error, 130 cancelled, 2 usage or request error.
    Ctrl-C cancels the call (a queued one never runs; a running one's forward pass is
    stopped, the replica's workers killed) and exits 130 once it has ended.
    """
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="PAYLOAD_JSON") from None
    if not isinstance(body, dict):
        raise click.BadParameter("must be a JSON object", param_hint="PAYLOAD_JSON")
    try:
        result = ctl.client.call(name, body, timeout_s=timeout_s, job=job, gpus=gpus)
    except CallInterrupted as exc:  # Ctrl-C: the client cancelled the call
        result = call_interrupted_result(exc)
    except ConnectionFailed as exc:
        fail(unreachable_message(ctl.path, exc), EXIT_INFRA)
    except TangramError as exc:
        if exc.code in REQUEST_ERRORS:
            fail(f"{exc.code}: {humanize_sizes(exc.message)}", EXIT_USAGE)
        fail(f"{exc.code}: {humanize_sizes(exc.message)}", EXIT_INFRA)
    if as_json:
        click.echo(to_json({**result.to_wire(), "job": job or ctl.client.job or "default"}))
    elif result.outcome == "ok":
        click.echo(to_json(result.result))
    else:
        click.echo(f"tangramctl: {result.outcome}: {result.error or 'no answer'}", err=True)
    sys.exit(call_exit_code(result))


def call_interrupted_result(exc: CallInterrupted) -> CallResult:
    """Ctrl-C on ``call``: the client cancelled the call and it has ended; how (exit 130
    when it was cancelled; its own status when it had ended before)."""
    result = exc.result
    if result is None:  # its answer could not be read (a second Ctrl-C)
        return CallResult("cancelled", error="interrupted (Ctrl-C); its answer was not read")
    if result.outcome == "cancelled":
        why = f"interrupted (Ctrl-C): {result.error}" if result.error else "interrupted (Ctrl-C)"
        return replace(result, error=why)
    return result


# --------------------------------------------------------------------------- attached


def _attach_optional(module: str, name: str, attr: str | None = None) -> None:
    """Add command ``name`` (the module's attribute ``attr``, default ``name``) from
    ``module``; if that module cannot load, a stub explains."""
    import importlib

    try:
        command = getattr(importlib.import_module(module), attr or name)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return  # not written (yet): the CLI works without it
        error: BaseException = exc
    except (ImportError, AttributeError) as exc:
        error = exc
    else:
        cli.add_command(command, name)
        return

    @cli.command(name, context_settings={"ignore_unknown_options": True}, add_help_option=False)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def unavailable(args: tuple[str, ...]) -> None:
        fail(f"{name} is unavailable: {type(error).__name__}: {error}", 1)


_attach_optional("tangramctl.profile", "profile")
_attach_optional("tangramctl.simulate", "simulate")
_attach_optional("tangramctl.ray", "ray", "ray_group")  # Ray itself loads only when used


def leaf_commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command of ``group``'s tree that is not itself a group, with its path."""
    out: list[tuple[tuple[str, ...], click.Command]] = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out += leaf_commands(command, (*path, name))
        else:
            out.append(((*path, name), command))
    return out


# Commands that never ask the daemon: the simulator (local), Ray's (they find it in Ray).
NO_SOCKET = ("simulate", "ray")


def _socket_here(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.find_object(Ctl).socket = value  # type: ignore[union-attr]  # the root made it


def _accept_socket_after_the_command() -> None:
    """``tangramctl status --socket PATH`` works as ``tangramctl --socket PATH status``."""
    for path, command in leaf_commands(cli):
        opts = {o for p in command.params if isinstance(p, click.Option) for o in p.opts}
        if path[0] in NO_SOCKET or "--socket" in opts:
            continue
        command.params.append(
            click.Option(
                ["--socket"],
                metavar="PATH",
                expose_value=False,
                callback=_socket_here,
                help="tangramd's socket, as `tangramctl --socket PATH` (either place works).",
            )
        )


_accept_socket_after_the_command()


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``tangramctl``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="tangramctl")


if __name__ == "__main__":
    main()
