"""tangramd.config: TOML → frozen dataclasses → defaults → validation, and its parsers."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from tangramd.config import (
    GIB,
    MIB,
    Config,
    ConfigError,
    ServiceConfig,
    default_socket,
    format_cores,
    load_config,
    parse_cores,
    parse_size,
)

REPO = Path(__file__).resolve().parent.parent
HOST_CORES = tuple(sorted(os.sched_getaffinity(0)))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tangram.toml"
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- defaults


def test_defaults_without_a_file() -> None:
    """No file and no overrides gives the documented defaults, with host values resolved."""
    config = load_config(None, {})
    assert config.daemon.log_format == "auto"
    assert config.daemon.log_level == "info"
    assert config.daemon.max_frame_bytes == 16 * MIB
    assert config.daemon.idle_timeout_s == 300.0
    assert config.cpu.backend == "process"
    assert config.cpu.cores == HOST_CORES
    assert config.cpu.mem > 0
    assert config.cpu.default_env_mem == GIB
    assert config.cpu.env_idle_ttl_s == 1800.0
    assert config.cpu.max_output_bytes == MIB
    assert config.cpu.docker_image == "tangram-test:bookworm"
    assert config.cpu.exec_agent is True
    assert (config.sched.depth, config.sched.order) == (2, "fcfs")
    assert config.sched.starvation_s == 30.0
    assert config.sched.coalesce_ms == 0.0
    assert config.sched.replay_limit == 512
    assert config.gpu.simulated is None and config.gpu.nvml is True
    assert (config.gpu.load_timeout_s, config.gpu.restore_timeout_s) == (300.0, 600.0)
    assert config.apis == () and config.services == ()
    assert config.path is None


def test_config_is_frozen() -> None:
    """Config objects are immutable, so no component can change another's view at runtime."""
    config = load_config(None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cpu.backend = "docker"  # type: ignore[misc]


def test_simulated_gpu_inventory(tmp_path: Path) -> None:
    """`[gpu] simulated = {count, mem_gb, h2d_gbps}` is read as one inline table."""
    path = write(tmp_path, "[gpu]\nsimulated = { count = 2, mem_gb = 0.5 }\nnvml = false\n")
    gpu = load_config(path, {}).gpu
    assert (gpu.simulated.count, gpu.simulated.mem_gb, gpu.simulated.h2d_gbps) == (2, 0.5, 25.0)
    assert gpu.nvml is False


def test_api_and_service_defaults(tmp_path: Path) -> None:
    """Array tables get per-entry defaults and keep their order."""
    path = write(
        tmp_path,
        '[[api]]\nname = "search"\nquota = 100\n\n[[api]]\nname = "pdf"\n\n'
        '[[service]]\nname = "judge"\nmem_gb = 40\ngpus = [4, 1, 2]\nentry = "m:make"\n',
    )
    config = load_config(path, {})
    search, pdf = config.apis
    assert (search.name, search.quota, search.concurrency) == ("search", 100, 0)
    assert (search.period_s, search.overflow, search.ttl_s, search.deadline_s) == (
        60.0,
        "wait",
        60.0,
        30.0,
    )
    assert pdf.name == "pdf" and config.api("pdf") is pdf and config.api("nope") is None
    (judge,) = config.services
    assert (judge.runtime, judge.gpus, judge.mem_gb) == ("torch", (1, 2, 4), 40.0)
    assert (judge.max_batch, judge.batch_window_ms, judge.min_resident) == (1, 0.0, 0)
    assert judge.spec().to_json() == {
        "name": "judge",
        "runtime": "torch",
        "mem_gb": 40.0,
        "gpus": [1, 2, 4],
        "entry": "m:make",
    }


def test_shipped_example_loads() -> None:
    """config/tangram.toml, the documented example, is itself a valid config."""
    config = load_config(REPO / "config" / "tangram.toml", {})
    assert isinstance(config, Config)
    assert config.daemon.socket == "/run/tangram/tangramd.sock"
    assert config.path is not None and config.path.endswith("tangram.toml")


def test_shipped_example_documents_every_key() -> None:
    """Every key of every section appears in the shipped example (commented or not)."""
    text = (REPO / "config" / "tangram.toml").read_text()
    config = load_config(None, {})
    sections: dict[str, Any] = {
        "daemon": config.daemon,
        "cpu": config.cpu,
        "sched": config.sched,
        "gpu": config.gpu,
        "http": config.http,
    }
    for section, value in sections.items():
        assert f"[{section}]" in text
        for spec in dataclasses.fields(value):
            assert f"\n{spec.name} = " in text, f"{section}.{spec.name} is undocumented"
    for cls_name, entry_keys in (
        ("api", ("name", "concurrency", "quota", "period_s", "overflow", "ttl_s", "deadline_s")),
        ("service", tuple(f.name for f in dataclasses.fields(ServiceConfig))),
    ):
        assert f"[[{cls_name}]]" in text
        for key in entry_keys:
            assert f"# {key} = " in text, f"{cls_name}.{key} is undocumented"


def test_values_from_file(tmp_path: Path) -> None:
    """Values in the file replace defaults and are converted to their units."""
    path = write(
        tmp_path,
        '[daemon]\nsocket = "/tmp/t.sock"\nmax_frame_bytes = "1MiB"\nlog_level = "DEBUG"\n'
        f'[cpu]\nbackend = "docker"\nmem = "2GiB"\ncores = [{HOST_CORES[0]}]\n'
        'default_env_mem = 268435456\n[sched]\norder = "backfill"\ncoalesce_ms = 0\n',
    )
    config = load_config(path, {})
    assert config.daemon.socket == "/tmp/t.sock"
    assert config.daemon.max_frame_bytes == MIB
    assert config.daemon.log_level == "debug"
    assert (config.cpu.backend, config.cpu.mem) == ("docker", 2 * GIB)
    assert config.cpu.cores == (HOST_CORES[0],)
    assert config.cpu.default_env_mem == 256 * MIB
    assert (config.sched.order, config.sched.coalesce_ms) == ("backfill", 0.0)


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    """--socket, --state-dir and --cpu-backend beat the file; None means 'not given'."""
    path = write(tmp_path, '[daemon]\nsocket = "/tmp/file.sock"\n[cpu]\nbackend = "docker"\n')
    config = load_config(
        path,
        {
            "daemon.socket": "/tmp/flag.sock",
            "daemon.state_dir": None,
            "cpu": {"backend": "process"},
        },
    )
    assert config.daemon.socket == "/tmp/flag.sock"
    assert config.cpu.backend == "process"
    assert config.daemon.state_dir == load_config(None, {}).daemon.state_dir


def test_default_socket_follows_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """$TANGRAM_SOCKET sets the daemon's default socket, as it does the client's."""
    monkeypatch.setenv("TANGRAM_SOCKET", "/tmp/from-env.sock")
    assert default_socket() == "/tmp/from-env.sock"
    assert load_config(None, {}).daemon.socket == "/tmp/from-env.sock"


def test_default_socket_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $TANGRAM_SOCKET: the system socket as root, else a per-user path."""
    monkeypatch.delenv("TANGRAM_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    expected = (
        "/run/tangram/tangramd.sock"
        if os.geteuid() == 0
        else "/run/user/1000/tangram/tangramd.sock"
    )
    assert default_socket() == expected


# --------------------------------------------------------------------------- bad configs

OUTSIDE_CORE = max(HOST_CORES) + 1
SVC = "[[service]]\nname = 's'\nmem_gb = 1\n"  # a valid service (with entry) to spoil
SVT = SVC + "entry = 'm:f'\n"

# (name, file text, dotted key the error must name, text the error must contain)
BAD_CONFIGS = [
    ("unknown section", "[cpus]\nbackend = 'docker'\n", "cpus", "daemon, cpu"),
    ("unknown key", "[cpu]\nbakend = 'docker'\n", "cpu.bakend", "backend"),
    ("bad backend", "[cpu]\nbackend = 'podman'\n", "cpu.backend", "'process', 'docker'"),
    ("bad log format", "[daemon]\nlog_format = 'xml'\n", "daemon.log_format", "'console'"),
    ("bad event loop", "[daemon]\nevent_loop = 'trio'\n", "daemon.event_loop", "'uvloop'"),
    ("bad log level", "[daemon]\nlog_level = 'loud'\n", "daemon.log_level", "'warning'"),
    ("frame too small", "[daemon]\nmax_frame_bytes = 10\n", "daemon.max_frame_bytes", "1024"),
    ("negative timeout", "[daemon]\nidle_timeout_s = -1\n", "daemon.idle_timeout_s", "> 0"),
    ("socket not a string", "[daemon]\nsocket = 5\n", "daemon.socket", "non-empty"),
    ("bad size", "[cpu]\nmem = '16 parsecs'\n", "cpu.mem", "16GiB"),
    ("float size", "[cpu]\ndefault_env_mem = 1.5\n", "cpu.default_env_mem", "512MiB"),
    ("env mem > total", "[cpu]\nmem = 1024\ndefault_env_mem = 2048\n", "cpu.default_env_mem", "up"),
    ("core off host", f"[cpu]\ncores = [{OUTSIDE_CORE}]\n", "cpu.cores", "affinity"),
    ("core range off host", f"[cpu]\ncores = '0-{OUTSIDE_CORE}'\n", "cpu.cores", "'all'"),
    ("reversed core range", "[cpu]\ncores = '3-1'\n", "cpu.cores", "reversed"),
    ("duplicate core", "[cpu]\ncores = [0, 0]\n", "cpu.cores", "twice"),
    ("empty core list", "[cpu]\ncores = []\n", "cpu.cores", "empty"),
    ("bool as bool only", "[cpu]\nexec_agent = 'yes'\n", "cpu.exec_agent", "true, false"),
    ("depth zero", "[sched]\ndepth = 0\n", "sched.depth", ">= 1"),
    ("depth float", "[sched]\ndepth = 2.5\n", "sched.depth", "integers"),
    ("bad order", "[sched]\norder = 'lifo'\n", "sched.order", "'fcfs', 'backfill'"),
    ("api without name", "[[api]]\nquota = 5\n", "api[0].name", "missing"),
    ("bad overflow", "[[api]]\nname = 'a'\noverflow = 'drop'\n", "api[0].overflow", "'deadline'"),
    ("negative quota", "[[api]]\nname = 'a'\nquota = -1\n", "api[0].quota", ">= 0"),
    ("zero period", "[[api]]\nname = 'a'\nperiod_s = 0\n", "api[0].period_s", "> 0"),
    ("duplicate api", "[[api]]\nname = 'a'\n[[api]]\nname = 'a'\n", "api[1].name", "duplicate"),
    ("api as table", "[api]\nname = 'a'\n", "api", "[[api]]"),
    ("bad api name", "[[api]]\nname = 'a b'\n", "api[0].name", "letters"),
    ("negative gpus", "[gpu]\nsimulated = {count = -2, mem_gb = 1}\n", "gpu.simulated", ">= 0"),
    ("three gpus", "[gpu]\nsimulated = {count = 3, mem_gb = 1}\n", "gpu.simulated", "1, 2, 4, 8"),
    ("gpus no mem", "[gpu]\nsimulated = {count = 2}\n", "gpu.simulated", "mem_gb"),
    ("gpus bad key", "[gpu]\nsimulated = {count = 2, mem = 1}\n", "gpu.simulated", "h2d_gbps"),
    ("old gpu key", "[gpu]\nsimulated_count = 2\n", "gpu.simulated_count", "simulated"),
    ("service gpus 3", SVT + "gpus = [3]\n", "service[0].gpus", "1, 2, 4, 8"),
    ("service no mem", "[[service]]\nname = 's'\n", "service[0].mem_gb", "missing"),
    ("bad runtime", SVT + "runtime = 'onnx'\n", "service[0].runtime", "'torch', 'http'"),
    ("torch needs entry", SVC + "runtime = 'torch'\n", "service[0].entry", "module:factory"),
    ("torch bad entry", SVC + "runtime = 'torch'\nentry = 'x'\n", "service[0].entry", "factory"),
    ("http needs cmd", SVC + "runtime = 'http'\n", "service[0].cmd", "{port}"),
    ("unknown service key", SVT + "batch = 8\n", "service[0].batch", "max_batch, batch_window"),
    ("old dop key", SVT + "dop = [1]\n", "service[0].dop", "gpus"),
    ("max_batch 0", SVT + "max_batch = 0\n", "service[0].max_batch", ">= 1"),
    ("max_batch huge", SVT + "max_batch = 5000\n", "service[0].max_batch", "1 to 4096"),
    ("negative window", SVT + "batch_window_ms = -1\n", "service[0].batch_window_ms", ">= 0"),
    ("min_resident float", SVT + "min_resident = 1.5\n", "service[0].min_resident", "integers"),
    ("eff off gpus", SVT + "eff = '1:1,2:1.8'\n", "service[0].eff", "not one of gpus"),
    ("eff garbage", SVT + "eff = 'fast'\n", "service[0].eff", "1:1,2:1.8"),
    ("relative path", SVT + "path = 'models'\n", "service[0].path", "absolute"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [case[1:] for case in BAD_CONFIGS],
    ids=[case[0] for case in BAD_CONFIGS],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, key: str, needle: str) -> None:
    """A bad config fails with a ConfigError naming the file, the dotted key and the allowed."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert info.value.key == key
    assert needle in message, message


def test_bad_override_names_the_command_line() -> None:
    """A bad flag value is blamed on the command line, not on the file."""
    with pytest.raises(ConfigError) as info:
        load_config(None, {"cpu.backend": "podman"})
    assert str(info.value).startswith("<command line>: cpu.backend: got 'podman'")


def test_unknown_override_key() -> None:
    """An override for a key that does not exist is an error, not silently dropped."""
    with pytest.raises(ConfigError, match=r"daemon\.sokcet"):
        load_config(None, {"daemon.sokcet": "/tmp/x"})


def test_missing_file() -> None:
    """A config path that does not exist is a ConfigError naming the path."""
    with pytest.raises(ConfigError, match=r"/nonexistent/tangram\.toml: no such file"):
        load_config("/nonexistent/tangram.toml", {})


def test_invalid_toml(tmp_path: Path) -> None:
    """Invalid TOML is a ConfigError naming the file and the parser's position."""
    path = write(tmp_path, "[cpu\nbackend = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, {})


# --------------------------------------------------------------------------- parsers

SIZES = [
    ("16GiB", 16 * GIB),
    ("16G", 16 * GIB),
    ("16gb", 16 * GIB),
    ("512M", 512 * MIB),
    ("1.5GiB", 3 * GIB // 2),
    ("1024", 1024),
    (" 2 KiB ", 2048),
    ("0", 0),
    (4096, 4096),
]


@pytest.mark.parametrize(("text", "expected"), SIZES, ids=[str(s[0]) for s in SIZES])
def test_parse_size(text: str | int, expected: int) -> None:
    """Sizes accept ints and binary-unit strings in any case."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", -1, "1.5.5G", "12 parsecs", "1e9", True, 1.5])
def test_parse_size_rejects(text: object) -> None:
    """Anything that is not a non-negative size raises ValueError."""
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


CORES = [
    ("0", (0,)),
    ("0-3,6", (0, 1, 2, 3, 6)),
    ("6,0-1", (0, 1, 6)),
    (" 2 - 4 , 8 ", (2, 3, 4, 8)),
]


@pytest.mark.parametrize(("text", "expected"), CORES, ids=[c[0] for c in CORES])
def test_parse_cores(text: str, expected: tuple[int, ...]) -> None:
    """Kernel-style core lists parse to sorted core ids and format back the same way."""
    assert parse_cores(text) == expected
    assert parse_cores(format_cores(expected)) == expected


@pytest.mark.parametrize("text", ["", "a", "3-1", "0,0", "1-2,2", "-1", "0-", "0;1"])
def test_parse_cores_rejects(text: str) -> None:
    """Malformed, reversed, negative or duplicated core lists raise ValueError."""
    with pytest.raises(ValueError):
        parse_cores(text)


def test_format_cores() -> None:
    """Core tuples render as compact kernel-style ranges."""
    assert format_cores((0, 1, 2, 3, 6)) == "0-3,6"
    assert format_cores((5,)) == "5"
    assert format_cores((1, 3, 4)) == "1,3-4"
