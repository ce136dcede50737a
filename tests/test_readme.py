"""The README's code blocks work as pasted (issue 35, items 6 and 8).

Every ```bash and ```python block of README.md is either run here, against the real
daemons it starts itself, or listed in ``NOT_RUN`` with the reason; every block is at least
syntax-checked (``bash -n``, ``compile``). A block the lists do not know fails
``test_every_block_is_run_or_excused``: a new README block gets a decision.

The blocks run as a reader pastes them into one terminal: each shell below is one bash
process that sources the blocks in README order (so ``export TANGRAM_SOCKET=…`` and ``$ENV``
carry over), a ```python block through ``python - <<EOF``, each with its own timeout, under
``set -e -o pipefail`` (a failing command fails the block). What differs from a terminal,
each for the stated reason (see ``edited``):

- every ``/tmp/`` path moves under a fresh temporary directory (parallel runs, other
  daemons on the host), and the clusters' ports 7317 and 7318 become a free loopback port;
- the line ``. .venv/bin/activate`` is skipped: the test runs with its own interpreter,
  whose bin directory comes first on PATH (the venv's, under scripts/test.sh), with this
  tree first on PYTHONPATH (whatever the interpreter's install of arl-tangram points at).

Daemons a block starts in the background are stopped (SIGTERM, then SIGKILL) when the
shell's test ends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psutil
import pytest

from tangram.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# The exact line skipped (it is the reader's set-up; this test brings its own interpreter).
ACTIVATE = ". .venv/bin/activate"

# Blocks not run here, by the start of their first line, with the reason. They are still
# syntax-checked.
NOT_RUN = {
    "bash scripts/demo.sh": "installs everything (pip, apt, Docker) for minutes: CI runs "
    "scripts/test.sh itself, and tests/test_demo.py runs the demo",
    "bash .ci/docker-setup.sh": "installs docker.io, starts dockerd and builds the test image "
    "as root (scripts/test.sh runs it); the docker-marked tests run the Docker backend",
    "ray start --head": "needs Ray and starts a Ray cluster (tests/test_ray.py starts one)",
    "pip install -e '.[dev,gpu,http,ray]'": "installs the extras and runs the whole test "
    "suite (this test among them)",
    "python bench/sched.py": "benchmarks: minutes each, machine-dependent numbers",
    "import skyrl_gym": "a fragment (src, chat and model_turn are the reader's); "
    "tests/test_integrations_skyrl.py runs the environment",
}

# The shells run here: the blocks (by the start of their first line) each one sources, in
# README order, with a timeout in seconds per block.
SHELLS = {
    "using-it": [
        (ACTIVATE, 60),  # starts the daemon, waits for it (--wait 30)
        ("tangramctl profile --dop 1,2", 120),
        ("from tangram import Client", 60),
        ("# GRPO: prepare once", 60),
        ("tangramctl profiles show unit-tests", 60),
    ],
    "gpu-services": [("cat > /tmp/tangram-gpu.toml", 180)],
    "cluster": [("tangramd coordinator", 120)],
    "gpu-cluster": [("mkdir -p /tmp/tg-gpu", 240)],
    "simulator": [("tangramctl simulate", 60)],
}


@dataclass(frozen=True)
class Block:
    lang: str  # "bash" or "python"
    text: str
    line: int  # of the opening fence in README.md

    @property
    def key(self) -> str:
        return next(ln.strip() for ln in self.text.splitlines() if ln.strip())

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang}: {self.key[:60]})"


def readme_blocks() -> list[Block]:
    """The ```bash and ```python blocks of README.md (also those indented in a list)."""
    blocks: list[Block] = []
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(bash|python)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        indent, start = len(m.group(1)), i
        body: list[str] = []
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:])
            i += 1
        blocks.append(Block(m.group(2), "\n".join(body) + "\n", start + 1))
        i += 1
    return blocks


def find(key: str) -> Block:
    found = [b for b in readme_blocks() if b.key.startswith(key)]
    assert len(found) == 1, f"README blocks starting with {key!r}: {[str(b) for b in found]}"
    return found[0]


def test_every_block_is_run_or_excused() -> None:
    """Each block is run by a shell below or listed in NOT_RUN, and each entry of either
    list names exactly one block."""
    run = [key for blocks in SHELLS.values() for key, _ in blocks]
    for key in [*run, *NOT_RUN]:
        find(key)
    for block in readme_blocks():
        assert any(block.key.startswith(k) for k in [*run, *NOT_RUN]), (
            f"{block}: neither run by tests/test_readme.py nor listed in its NOT_RUN"
        )


@pytest.mark.parametrize("block", readme_blocks(), ids=str)
def test_block_syntax(block: Block) -> None:
    """Every block parses: ``bash -n`` for shell, ``compile`` for Python."""
    if block.lang == "python":
        compile(block.text, str(block), "exec")
        return
    r = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert r.returncode == 0, f"{block}: {r.stderr}"


def test_using_it_starts_with_the_venv() -> None:
    """The "Using it" block starts by activating the project venv the scripts make."""
    assert find(ACTIVATE).text.splitlines()[0] == ACTIVATE


# --------------------------------------------------------------------------- running


def edited(block: Block, tmp: str, port: int) -> str:
    """The block as this test runs it (``EDITS`` in the module docstring)."""
    text = block.text.replace("/tmp/", f"{tmp}/")
    for listen in ("127.0.0.1:7317", "127.0.0.1:7318"):  # (one cluster per shell)
        text = text.replace(listen, f"127.0.0.1:{port}")
    lines = [
        f"# skipped by tests/test_readme.py: {ln}" if ln.strip() == ACTIVATE else ln
        for ln in text.splitlines()
    ]
    text = "\n".join(lines) + "\n"
    if block.lang == "python":
        assert "README_PY" not in text
        text = f"\"$README_PYTHON\" - <<'README_PY'\n{text}README_PY\n"
    return text


class Shell:
    """One bash process fed blocks as a terminal is; its output is collected by a thread."""

    def __init__(self, tmp: str) -> None:
        bindir = os.path.dirname(sys.executable)
        env = dict(os.environ)
        env.pop("TANGRAM_SOCKET", None)
        env.update(
            PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
            # this tree, whatever the interpreter's install of it points at
            PYTHONPATH=f"{ROOT}{os.pathsep}{env['PYTHONPATH']}"
            if env.get("PYTHONPATH")
            else str(ROOT),
            README_PYTHON=sys.executable,
        )
        self.tmp = tmp
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-s"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # apart: the daemons' logs do not cut into the output
            text=True,
            start_new_session=True,  # its own process group: the daemons it starts too
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []  # stderr: the blocks' and the daemons' (their logs)
        self.errors_seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.error_reader = threading.Thread(target=self._read_errors, daemon=True)
        self.error_reader.start()
        self._send("set -e -o pipefail")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.errors_seen:
                self.errors.append(line)
                self.errors_seen.notify_all()

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def run(self, block: Block, n: int, script: str, timeout_s: float) -> str:
        """Source ``script`` (stdin: /dev/null, as nothing is typed after a paste); return
        its standard output, or fail naming the block, its output and why."""
        path = Path(self.tmp) / f"block-{n}.sh"
        path.write_text(script)
        marker = f"@@README-BLOCK-{n}-DONE"
        first_error = len(self.errors)
        self._send(f"source {shlex.quote(str(path))} </dev/null; echo {marker}; echo {marker} >&2")
        out: list[str] = []
        t0 = time.monotonic()
        deadline = t0 + timeout_s

        def errors() -> list[str]:
            return self.errors[first_error:]

        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(block, out, errors(), f"not done within {timeout_s} s")
            if line is None:
                why = f"the shell exited ({self.proc.wait()}): a command failed"
                self.error_reader.join(5)  # its last words (daemons it started may hold on)
                self.fail(block, out, errors(), why)
            if line.strip() == marker:
                break
            out.append(line)
        with self.errors_seen:  # the block's stderr, to its end
            self.errors_seen.wait_for(
                lambda: marker + "\n" in errors(), max(0.0, deadline - time.monotonic())
            )
        print(f"{block}: {time.monotonic() - t0:.1f} s")
        if any("command not found" in line for line in errors()):
            self.fail(block, out, errors(), "command not found")
        return "".join(out)

    def fail(self, block: Block, out: list[str], errors: list[str], why: str) -> NoReturn:
        shown = "".join(ln for ln in errors if not ln.startswith('{"timestamp"'))  # logs
        pytest.fail(
            f"{block}: {why}\n--- its stdout:\n{''.join(out)}"
            f"--- its stderr (daemon logs left out):\n{shown}"
        )

    def close(self) -> None:
        """End the shell and everything it started (SIGTERM, then SIGKILL after 15 s)."""
        pgid = self.proc.pid
        with_group = [p for p in psutil.process_iter() if _pgid(p) == pgid]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in with_group:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(sig)
            _, with_group = psutil.wait_procs(with_group, timeout=15)
            if not with_group:
                break
        self.proc.wait(10)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


@pytest.fixture
def shell() -> Iterator[Shell]:
    with tempfile.TemporaryDirectory(prefix="readme-", dir="/tmp") as tmp:
        sh = Shell(tmp)
        try:
            yield sh
        finally:
            sh.close()


def run_shell(shell: Shell, name: str) -> list[str]:
    port = free_port()
    outputs = []
    for n, (key, timeout_s) in enumerate(SHELLS[name]):
        block = find(key)
        outputs.append(shell.run(block, n, edited(block, shell.tmp, port), timeout_s))
    return outputs


def test_using_it_profile_and_rollout_worker(shell: Shell) -> None:
    """In one shell, one after another: "Using it", the profile the rollout-worker example
    names, that example (against the daemon "Using it" started, with the `search` API it
    configured), the GRPO fork recipe and "Elasticity profiles"."""
    started, profiled, worker, grpo, elastic = run_shell(shell, "using-it")
    assert "Cpus_allowed_list" in started
    assert '"outcome": "ok"' in started and "search" in started
    assert "T1 = " in profiled
    # print(r.outcome, r.exit_code, r.queue_s, r.exec_s, r.cores)
    assert re.search(r"^ok 0 \S+ \S+ \([\d, ]+\)$", worker, re.M), worker
    assert grpo.split() == ["2", "1", "1"], grpo  # GRPO: a child's edit, the base, reset
    assert "name:    unit-tests" in elastic and "16 passed" in elastic


def test_gpu_services(shell: Shell) -> None:
    """The GPU services block: a daemon with simulated GPUs, the example reward model
    registered, listed and called."""
    (out,) = run_shell(shell, "gpu-services")
    assert re.search(r"^reward\s+torch\s", out, re.M), out
    assert '"outcome": "ok"' in out and '"model": "reward_small"' in out


def test_cluster_on_one_host(shell: Shell) -> None:
    """The "Run a cluster" block on one host: the coordinator, three nodes that join once
    it answers (--wait), one core each even on a two-core host, an exec through node-1."""
    (out,) = run_shell(shell, "cluster")
    for i in (1, 2, 3):
        assert re.search(rf"^node-{i}\s+ready\s", out, re.M), out
    assert '"node": "node-1"' in out


def test_gpu_services_on_a_cluster(shell: Shell) -> None:
    """The "GPU services on a cluster" block: a coordinator and two nodes with simulated
    GPUs, the example reward model registered through one node and called through the
    other; the answer and `service list` name the node each replica is on."""
    (out,) = run_shell(shell, "gpu-cluster")
    assert '"outcome": "ok"' in out and '"model": "reward_small"' in out, out
    assert re.search(r'"node": "gpu-[ab]"', out), out


def test_simulator(shell: Shell) -> None:
    """The simulator block prints its JSON comparison."""
    (out,) = run_shell(shell, "simulator")
    assert '"trajectories": 64' in out
