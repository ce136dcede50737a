"""Daemon configuration (docs/design.md §6): TOML → frozen dataclasses → defaults → validation.

Three steps, each in one place:

1. :func:`_read_toml` parses the file (``tomllib``; ``tomli`` before Python 3.11);
2. :func:`_build` walks the dataclasses below, takes each key from the command-line
   overrides, else the file, else its default, and converts it with the field's parser
   (unknown sections and keys are errors: a typo must not silently become a default);
3. :func:`_validate` checks what needs more than one key or the host (cores against the
   affinity mask, duplicate names, runtime-specific keys).

Every failure is a :class:`ConfigError` that names the file, the dotted key and the allowed
values, e.g. ``tangram.toml: cpu.backend: got 'podman' (allowed: 'process', 'docker')``.
Every key is documented, with its unit, in ``config/tangram.toml``.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Final

from tangram import sched
from tangram.jobs import JobError, parse_jobs
from tangram.protocol.errors import BadRequest
from tangram.protocol.ops import parse_size as wire_parse_size
from tangram.protocol.paths import default_socket_path
from tangram.sched import ORDERS, RULES, Job

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MIB: Final = 1 << 20
GIB: Final = 1 << 30
SYSTEM_STATE_DIR: Final = "/var/lib/tangram"
LOG_FORMATS: Final = ("auto", "json", "console")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
EVENT_LOOPS: Final = ("auto", "uvloop", "asyncio")
CPU_BACKENDS: Final = ("process", "docker")
OVERFLOW_POLICIES: Final = ("wait", "reject", "deadline")
SERVICE_RUNTIMES: Final = ("torch", "http")
HTTP_APIS: Final = ("vllm", "sglang")
GPU_DOPS: Final = (1, 2, 4, 8)  # buddy chunk sizes (docs/design.md §5.3)
COMMAND_LINE: Final = "<command line>"

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class ConfigError(ValueError):
    """A bad configuration: names the file, the dotted key and what is allowed."""

    def __init__(self, source: str, key: str, problem: str, allowed: str = "") -> None:
        text = f"{source}: {key}: {problem}" if key else f"{source}: {problem}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)
        self.source = source
        self.key = key
        self.problem = problem
        self.allowed = allowed


class _Bad(Exception):
    """Raised by a field parser; :func:`_build` adds the file and the key."""

    def __init__(self, problem: str, allowed: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.allowed = allowed


# --------------------------------------------------------------------------- public parsers

SIZE_DOC: Final = "bytes as an int, or a size like '512MiB', '16GiB', '1.5G' (binary units)"


def parse_size(text: str | int) -> int:
    """Bytes from ``"16GiB"``, ``"512M"``, ``"1.5g"`` or an int; raise ValueError.

    Units are binary (``K``/``KB``/``KiB`` all mean 1024): the wire protocol's own parser.
    """
    try:
        return wire_parse_size(text)
    except BadRequest:
        raise ValueError(f"expected {SIZE_DOC}, got {text!r}") from None


def parse_cores(text: str) -> tuple[int, ...]:
    """Sorted core ids from a kernel-style list such as ``"0-3,6"``; raise ValueError.

    Rejects empty lists, reversed ranges (``"3-1"``), negative ids and duplicates.
    """
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"([0-9]+)(?:\s*-\s*([0-9]+))?", part)
        if match is None:
            raise ValueError(f"bad core list item {part!r} in {text!r} (want e.g. '0-3,6')")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"reversed range {part!r} in {text!r}")
        cores.extend(range(lo, hi + 1))
    return _unique_cores(cores, text)


def _unique_cores(cores: list[int], text: object) -> tuple[int, ...]:
    if not cores:
        raise ValueError("empty core list")
    duplicates = sorted({c for c in cores if cores.count(c) > 1})
    if duplicates:
        raise ValueError(f"core(s) {duplicates} listed twice in {text!r}")
    return tuple(sorted(cores))


def format_cores(cores: tuple[int, ...] | list[int]) -> str:
    """The inverse of :func:`parse_cores`: ``(0, 1, 2, 3, 6)`` → ``"0-3,6"``."""
    parts: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------- field parsers


def _choice(*values: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in values:
            raise _Bad(f"got {value!r}", ", ".join(repr(v) for v in values))
        return value.lower()

    return parse


def _int(minimum: int = 0) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"expected an integer, got {value!r}", f"integers >= {minimum}")
        if value < minimum:
            raise _Bad(f"got {value}", f"integers >= {minimum}")
        return value

    return parse


MAX_MEM_GB = 1e6  # a GPU's (or service's) memory in GB: a petabyte is past any real one


def _number(
    minimum: float = 0.0, *, exclusive: bool = False, maximum: float = math.inf
) -> Callable[[Any], float]:
    allowed = f"numbers {'>' if exclusive else '>='} {minimum:g}"
    if maximum < math.inf:
        allowed += f" and <= {maximum:g}"

    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Bad(f"expected a number, got {value!r}", allowed)
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise _Bad(f"got {value}", allowed)
        if value > maximum:
            raise _Bad(f"got {value}", allowed)
        return float(value)

    return parse


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {value!r}", "true, false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"expected a non-empty string, got {value!r}", "non-empty strings")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise _Bad(f"got {value!r}", "names of letters, digits, '_', '.', '-' (at most 64)")
    return value


def _path(value: Any) -> str:
    return os.path.expanduser(os.path.expandvars(_text(value)))


def _size(minimum: int = 0) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise _Bad(str(exc), SIZE_DOC) from None
        if size < minimum:
            raise _Bad(f"got {size} bytes", f"sizes of at least {minimum} bytes")
        return size

    return parse


def _size_or_auto(value: Any) -> int | None:
    """``"auto"`` → None (resolved against the host in :func:`_validate`)."""
    if value == "auto":
        return None
    return _size(1)(value)


def _cores(value: Any) -> tuple[int, ...] | None:
    """``"all"`` → None (resolved against the host's affinity in :func:`_validate`)."""
    allowed = "'all', a list of core ids, or a string like '0-3,6'"
    if value == "all":
        return None
    try:
        if isinstance(value, str):
            return parse_cores(value)
        if isinstance(value, list) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value
        ):
            return _unique_cores(list(value), value)
    except ValueError as exc:
        raise _Bad(str(exc), allowed) from None
    raise _Bad(f"got {value!r}", allowed)


def _dops(value: Any) -> tuple[int, ...]:
    allowed = "a non-empty list of distinct values from 1, 2, 4, 8"
    if not isinstance(value, list) or not value:
        raise _Bad(f"got {value!r}", allowed)
    if any(isinstance(d, bool) or d not in GPU_DOPS for d in value) or len(set(value)) != len(
        value
    ):
        raise _Bad(f"got {value!r}", allowed)
    return tuple(sorted(value))


def _id_list(value: Any) -> tuple[int, ...]:
    """A list of numeric uids or gids (``[]``: no allowlist)."""
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value
    ):
        raise _Bad(f"got {value!r}", "a list of numeric ids, e.g. [1000, 1001]")
    return tuple(sorted(set(value)))


def _exec_user(value: Any) -> str:
    """``"peer"`` or an existing user (name or numeric uid) that commands run as."""
    text = _text(value)
    if text != "peer" and resolve_user(text) is None:
        raise _Bad(f"no such user {text!r}", "'peer', or a user name or uid of this host")
    return text


def resolve_user(name: str) -> tuple[int, int] | None:
    """(uid, gid) of a user given by name or numeric uid; None if there is none."""
    import pwd

    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        return None
    return entry.pw_uid, entry.pw_gid


def _opt_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _opt_path(value: Any) -> str | None:
    """A path, or None for ``""`` (so the shipped example can show the key unset)."""
    return None if value is None or value == "" else _text(value)


def _key(parse: Callable[[Any], Any], default: Any = MISSING, *, factory: Any = MISSING) -> Any:
    """A dataclass field whose raw TOML value goes through ``parse``; no default = required."""
    meta = {"parse": parse}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- defaults


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_socket() -> str:
    """Where ``tangramd`` listens unless told: the rule of :mod:`tangram.protocol.paths`,
    the same one ``tangram.Client`` follows to find it."""
    return default_socket_path()


def default_state_dir() -> str:
    """``/var/lib/tangram`` as root, else ``$XDG_STATE_HOME/tangram`` (``~/.local/state``)."""
    if _is_root():
        return SYSTEM_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "tangram")


def _host_cores() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def _host_mem() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency; sysconf is the fallback on odd installs
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --------------------------------------------------------------------------- the dataclasses


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """``[daemon]``: where the daemon listens and keeps state, and how it logs."""

    socket: str = _key(_path, factory=default_socket)
    state_dir: str = _key(_path, factory=default_state_dir)
    log_format: str = _key(_choice(*LOG_FORMATS), "auto")
    log_level: str = _key(_choice(*LOG_LEVELS), "info")
    event_loop: str = _key(_choice(*EVENT_LOOPS), "auto")
    max_frame_bytes: int = _key(_size(1024), 16 * MIB)
    idle_timeout_s: float = _key(_number(0.0, exclusive=True), 300.0)
    frame_timeout_s: float = _key(_number(0.0, exclusive=True), 30.0)
    max_connections: int = _key(_int(1), 4096)
    max_buffered_bytes: int = _key(_size(1024), 256 * MIB)
    allowed_uids: tuple[int, ...] = _key(_id_list, ())
    allowed_gids: tuple[int, ...] = _key(_id_list, ())
    operator_uids: tuple[int, ...] = _key(_id_list, ())


@dataclass(frozen=True, slots=True)
class CpuConfig:
    """``[cpu]``: the CPU manager. ``cores`` and ``mem`` are resolved against the host."""

    backend: str = _key(_choice(*CPU_BACKENDS), "process")
    cores: tuple[int, ...] = _key(_cores, None)  # None until resolved ("all")
    mem: int = _key(_size_or_auto, None)  # bytes; None until resolved ("auto")
    default_env_mem: int = _key(_size(1), GIB)
    env_idle_ttl_s: float = _key(_number(0.0, exclusive=True), 1800.0)
    max_output_bytes: int = _key(_size(1), MIB)
    docker_image: str = _key(_text, "tangram-test:bookworm")
    exec_agent: bool = _key(_bool, True)
    exec_user: str = _key(_exec_user, "peer")
    # process backend: each environment in its own namespaces ("auto": where the kernel
    # allows, else plain directories with one start-up line saying so)
    isolation: str = _key(_choice("auto", "namespaces", "none"), "auto")
    env_pids_max: int = _key(_int(1), 4096)
    env_network: str = _key(_choice("none", "host"), "none")


@dataclass(frozen=True, slots=True)
class SchedSection:
    """``[sched]``: the elastic scheduler (docs/design.md §4)."""

    depth: int = _key(_int(1), 2)
    order: str = _key(_choice(*ORDERS), "fcfs")
    rule: str = _key(_choice(*RULES), sched.SchedConfig().rule)
    starvation_s: float = _key(_number(0.0, exclusive=True), 30.0)
    coalesce_ms: float = _key(_number(0.0), 0.0)
    replay_limit: int = _key(_int(1), 512)
    max_branch: int = _key(_int(1), 4)
    share_half_life_s: float = _key(_number(0.0), 0.0)

    def scheduler(self) -> sched.SchedConfig:
        """The scheduler's own config: every scheduler key of this section, built once."""
        names = {f.name for f in fields(sched.SchedConfig)}
        return sched.SchedConfig(**{n: getattr(self, n) for n in names if hasattr(self, n)})


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """One ``[[api]]`` endpoint: a concurrency limit and/or a quota per period."""

    name: str = _key(_name)
    concurrency: int = _key(_int(0), 0)
    quota: int = _key(_int(0), 0)
    period_s: float = _key(_number(0.0, exclusive=True), 60.0)
    overflow: str = _key(_choice(*OVERFLOW_POLICIES), "wait")
    ttl_s: float = _key(_number(0.0, exclusive=True), 60.0)
    deadline_s: float = _key(_number(0.0, exclusive=True), 30.0)


@dataclass(frozen=True, slots=True)
class SimulatedGpuConfig:
    """``[gpu] simulated = { count = N, mem_gb = G, h2d_gbps = B }``."""

    count: int
    mem_gb: float
    h2d_gbps: float = 25.0


def _simulated(value: Any) -> SimulatedGpuConfig:
    """The inline table of a simulated inventory; ``count`` must suit the buddy pool."""
    if not isinstance(value, dict):
        raise _Bad(f"got {value!r}", "{ count = N, mem_gb = G, h2d_gbps = B }")
    unknown = sorted(set(value) - {"count", "mem_gb", "h2d_gbps"})
    if unknown:
        raise _Bad(f"unknown key {unknown[0]!r}", "count, mem_gb, h2d_gbps")
    for required in ("count", "mem_gb"):
        if required not in value:
            raise _Bad(f"missing {required!r}", "{ count = N, mem_gb = G, h2d_gbps = B }")
    positive = _number(0.0, exclusive=True)
    count = _sub("count", _int(0), value["count"])
    if count not in (0, *GPU_DOPS):
        raise _Bad(f"count: got {count}", "0, 1, 2, 4, 8 (a node's GPUs form buddy chunks)")
    mem_gb = _sub("mem_gb", _number(0.0, exclusive=True, maximum=MAX_MEM_GB), value["mem_gb"])
    h2d = _sub("h2d_gbps", positive, value.get("h2d_gbps", 25.0))
    return SimulatedGpuConfig(count, mem_gb, h2d)


def _sub(key: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """Parse one key of an inline table, naming the key in the problem."""
    try:
        return parse(value)
    except _Bad as exc:
        raise _Bad(f"{key}: {exc.problem}", exc.allowed) from None


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """``[gpu]``: the node's GPUs (NVML and/or simulated) and the service host's limits."""

    simulated: SimulatedGpuConfig | None = _key(_simulated, None)  # noqa: RUF009  # field(), default None
    nvml: bool = _key(_bool, True)
    load_timeout_s: float = _key(_number(0.0, exclusive=True), 300.0)
    http_load_timeout_s: float = _key(_number(0.0, exclusive=True), 900.0)
    restore_timeout_s: float = _key(_number(0.0, exclusive=True), 600.0)
    call_timeout_s: float = _key(_number(0.0, exclusive=True), 300.0)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """``[http]``: the HTTP gateway's limits (``tangramd http``, ``tangramd up --http``)."""

    max_body: int = _key(_size(1024), 16 * MIB)  # larger request bodies: 413, unread
    max_run_timeout_s: float = _key(_number(0.0, exclusive=True), 3600.0)  # above: 400
    keys: str | None = _key(_opt_path, None)  # file of "KEY [USER]" lines ("": none)
    max_connections: int = _key(_int(1), 1024)  # open at once (fewer if descriptors are short)
    read_timeout_s: float = _key(_number(0.0, exclusive=True), 30.0)  # headers, then body


def _gpus(value: Any) -> tuple[int, ...]:
    """GPUs per instance: one count, or the list of allowed counts."""
    allowed = "a count or a list of distinct counts from 1, 2, 4, 8"
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        return _dops(value)
    except _Bad:
        raise _Bad(f"got {value!r}", allowed) from None


def _eff(value: Any) -> dict[int, float]:
    """A speed-up per GPU count: ``"1:1,2:1.8"`` or ``{ 1 = 1.0, 2 = 1.8 }``."""
    allowed = "a string like '1:1,2:1.8' or a table like { 1 = 1.0, 2 = 1.8 } (speed-ups > 0)"
    if isinstance(value, str):
        from tangramd.services.spec import SpecError, parse_eff

        try:
            return parse_eff(value)
        except SpecError:
            raise _Bad(f"got {value!r}", allowed) from None
    if isinstance(value, dict):
        out: dict[int, float] = {}
        for key, speedup in value.items():
            if not str(key).isdigit():
                raise _Bad(f"GPU count {key!r} is not a number", allowed)
            out[int(key)] = _sub(str(key), _number(0.0, exclusive=True), speedup)
        return out
    raise _Bad(f"got {value!r}", allowed)


def _str_table(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or any(not isinstance(v, str) for v in value.values()):
        raise _Bad(f"got {value!r}", 'a table of strings, e.g. { HF_HOME = "/models" }')
    return dict(value)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """One ``[[service]]``: a GPU model service registered when ``tangramd up`` starts.

    The keys are ``tangramctl service register``'s options; :meth:`spec` is the
    registration (checked like one: :func:`_validate` turns its ``SpecError`` into a
    ``ConfigError`` naming ``service[i].KEY``).
    """

    name: str = _key(_name)
    mem_gb: float = _key(_number(0.0, exclusive=True, maximum=MAX_MEM_GB))
    runtime: str = _key(_choice(*SERVICE_RUNTIMES), "torch")
    entry: str | None = _key(_opt_text, None)  # torch: "module:factory"
    path: str | None = _key(_opt_path, None)  # torch: directory added to the import path
    gpus: tuple[int, ...] = _key(_gpus, (1,))
    eff: dict[int, float] = _key(_eff, factory=dict)  # noqa: RUF009  # field(), default {}
    max_batch: int = _key(_int(1), 1)
    batch_window_ms: float = _key(_number(0.0), 0.0)
    min_resident: int = _key(_int(0), 0)
    cmd: str | None = _key(_opt_text, None)  # http: server command line with {port}
    route: str = _key(_text, "/v1/completions")
    api: str = _key(_choice(*HTTP_APIS), "vllm")
    env: dict[str, str] = _key(_str_table, factory=dict)  # noqa: RUF009  # field(), default {}

    def spec(self) -> Any:
        """The registration (a ``tangramd.services.spec.ServiceSpec``); ``SpecError``."""
        from tangramd.services.spec import ServiceSpec

        return ServiceSpec(
            name=self.name,
            runtime=self.runtime,
            mem_gb=self.mem_gb,
            gpus=self.gpus,
            entry=self.entry,
            path=self.path,
            cmd=self.cmd,
            route=self.route,
            api=self.api,
            env=self.env,
            eff=self.eff,
            max_batch=self.max_batch,
            batch_window_ms=self.batch_window_ms,
            min_resident=self.min_resident,
        )


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration of ``tangramd``; ``path`` is the file it came from."""

    daemon: DaemonConfig
    cpu: CpuConfig
    sched: SchedSection
    gpu: GpuConfig
    apis: tuple[ApiConfig, ...] = ()
    services: tuple[ServiceConfig, ...] = ()
    path: str | None = None
    http: HttpConfig = field(default_factory=HttpConfig)
    # ``[[job]]``: the jobs' terms for fair share across jobs (tangram.jobs, issue 34); a
    # job not listed has weight 1, priority 0 and no cap
    jobs: Mapping[str, Job] = field(default_factory=dict)

    def api(self, name: str) -> ApiConfig | None:
        """The ``[[api]]`` entry called ``name``, if any."""
        return next((api for api in self.apis if api.name == name), None)


_TABLES: Final[dict[str, type]] = {
    "daemon": DaemonConfig,
    "cpu": CpuConfig,
    "sched": SchedSection,
    "gpu": GpuConfig,
    "http": HttpConfig,
}
_ARRAYS: Final[dict[str, tuple[str, type]]] = {
    "api": ("apis", ApiConfig),
    "service": ("services", ServiceConfig),
}


# --------------------------------------------------------------------------- step 1: read


def _read_toml(path: str | None) -> dict[str, Any]:
    """The parsed file, or ``{}`` without one; unreadable or invalid TOML is a ConfigError."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, "", "no such file") from None
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # (tomllib decodes the whole file first)
        raise ConfigError(path, "", f"not UTF-8 (byte {exc.start}): a TOML file is UTF-8") from None


# --------------------------------------------------------------------------- step 2: build


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"daemon": {"socket": x}}`` and ``{"daemon.socket": x}`` both → dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, dotted + "."))
        elif value is not None:  # click passes None for flags that were not given
            flat[dotted] = value
    return flat


def _build_table(cls: type, raw: Any, key: str, source: str, overrides: Mapping[str, Any]) -> Any:
    """One dataclass from one TOML table: overrides, else file, else default; parsed."""
    if not isinstance(raw, dict):
        raise ConfigError(source, key, f"expected a table, got {raw!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigError(source, f"{key}.{unknown[0]}", "unknown key", ", ".join(names))
    values: dict[str, Any] = {}
    for spec in fields(cls):
        dotted = f"{key}.{spec.name}"
        origin = COMMAND_LINE if dotted in overrides else source
        if dotted in overrides:
            value = overrides[dotted]
        elif spec.name in raw:
            value = raw[spec.name]
        elif spec.default is not MISSING or spec.default_factory is not MISSING:
            continue  # the dataclass default applies
        else:
            raise ConfigError(source, dotted, "missing required key")
        try:
            values[spec.name] = spec.metadata["parse"](value)
        except _Bad as exc:
            raise ConfigError(origin, dotted, exc.problem, exc.allowed) from None
    return cls(**values)


def _build(raw: Mapping[str, Any], source: str, overrides: Mapping[str, Any]) -> Config:
    known = [*_TABLES, *_ARRAYS, "job"]
    for section in raw:
        if section not in known:
            raise ConfigError(source, section, "unknown section", ", ".join(known))
    for dotted in overrides:
        section, _, name = dotted.partition(".")
        cls = _TABLES.get(section)
        if cls is None or name not in {f.name for f in fields(cls)}:
            raise ConfigError(COMMAND_LINE, dotted, "unknown override key")
    tables = {
        section: _build_table(cls, raw.get(section, {}), section, source, overrides)
        for section, cls in _TABLES.items()
    }
    arrays: dict[str, Any] = {}
    for section, (attr, cls) in _ARRAYS.items():
        entries = raw.get(section, [])
        if not isinstance(entries, list):
            raise ConfigError(source, section, "expected an array of tables", f"[[{section}]]")
        arrays[attr] = tuple(
            _build_table(cls, entry, f"{section}[{i}]", source, {})
            for i, entry in enumerate(entries)
        )
    try:
        jobs = parse_jobs(raw.get("job"))
    except JobError as exc:
        raise ConfigError(source, exc.key, exc.problem, exc.allowed) from None
    return Config(**tables, **arrays, jobs=jobs, path=None if source == COMMAND_LINE else source)


# --------------------------------------------------------------------------- step 3: validate


def _validate(config: Config, source: str, origin: Callable[[str], str]) -> Config:
    """Cross-key and host checks; returns the config with ``cores``/``mem`` resolved."""
    host_cores = _host_cores()
    cores = config.cpu.cores
    if cores is None:
        cores = host_cores
    else:
        outside = sorted(set(cores) - set(host_cores))
        if outside:
            raise ConfigError(
                origin("cpu.cores"),
                "cpu.cores",
                f"core(s) {format_cores(outside)} are not in this process's affinity",
                f"'all' or cores within {format_cores(host_cores)}",
            )
    mem = config.cpu.mem if config.cpu.mem is not None else _host_mem()
    if config.cpu.default_env_mem > mem:
        raise ConfigError(
            origin("cpu.default_env_mem"),
            "cpu.default_env_mem",
            f"{config.cpu.default_env_mem} bytes exceed cpu.mem ({mem} bytes)",
            f"sizes up to {mem} bytes",
        )
    _check_unique(source, "api", [api.name for api in config.apis])
    _check_unique(source, "service", [service.name for service in config.services])
    for i, service in enumerate(config.services):
        _check_service(source, i, service)
    return replace(config, cpu=replace(config.cpu, cores=cores, mem=mem))


def _check_service(source: str, i: int, service: ServiceConfig) -> None:
    """The entry as a registration: what ``service register`` would refuse, named."""
    from tangramd.services.spec import SpecError

    try:
        service.spec()
    except SpecError as exc:
        allowed = {
            "entry": "'module:factory' (runtime = 'torch')",
            "cmd": "a command line containing {port} (runtime = 'http')",
            "path": "an absolute directory",
        }.get(exc.field, "")
        raise ConfigError(source, f"service[{i}].{exc.field}", exc.problem, allowed) from None


def _check_unique(source: str, section: str, names: list[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(source, f"{section}[{i}].name", f"duplicate name {name!r}")
        seen.add(name)


# --------------------------------------------------------------------------- entry point


def load_config(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any]) -> Config:
    """Read ``path`` (None: defaults only), apply ``overrides``, validate; raise ConfigError.

    ``overrides`` holds dotted keys (``{"daemon.socket": ..., "cpu.backend": ...}``) or the
    same nested; ``None`` values are ignored, so click options can be passed through as they
    come. Overrides win over the file (``tangramd up --socket`` etc.).
    """
    return load_config_with(path, overrides, {})[0]


def load_config_with(
    path: str | os.PathLike[str] | None,
    overrides: Mapping[str, Any],
    sections: Mapping[str, type],
) -> tuple[Config, dict[str, Any]]:
    """:func:`load_config` for a file that also holds ``sections`` of another daemon
    (``{"cluster": ClusterConfig}``): each is built from its table (missing: defaults)
    with the same parsing and messages, its fields made with :func:`setting`. Returns the
    config and ``{section: instance}``; the path in errors is the file's."""
    source = os.fspath(path) if path is not None else None
    flat = _flatten(overrides)
    raw = dict(_read_toml(source))
    label = source if source is not None else COMMAND_LINE
    extra = {
        section: _build_table(cls, raw.pop(section, {}), section, label, {})
        for section, cls in sections.items()
    }
    config = _build(raw, label, flat)

    def origin(dotted: str) -> str:
        return COMMAND_LINE if dotted in flat else label

    return _validate(config, label, origin), extra


def setting(parse: Callable[[Any], Any], default: Any = MISSING) -> Any:
    """A field of a config section dataclass defined outside this module (for
    :func:`load_config_with`): its raw TOML value goes through ``parse``, such as
    :func:`number`; no default = a required key."""
    return _key(parse, default)


def number(minimum: float = 0.0, *, exclusive: bool = False) -> Callable[[Any], float]:
    """The parser of a number ``>= minimum`` (``> minimum`` when ``exclusive``)."""
    return _number(minimum, exclusive=exclusive)


def integer(minimum: int = 0) -> Callable[[Any], int]:
    """The parser of an integer ``>= minimum``."""
    return _int(minimum)


def size(minimum: int = 0) -> Callable[[Any], int]:
    """The parser of a size (bytes, or a string such as ``"64GiB"``) ``>= minimum``."""
    return _size(minimum)


def cli_overrides(
    *, socket: str | None = None, state_dir: str | None = None, cpu_backend: str | None = None
) -> dict[str, Any]:
    """The override map for ``tangramd``'s ``--socket``, ``--state-dir``, ``--cpu-backend``."""
    return {"daemon.socket": socket, "daemon.state_dir": state_dir, "cpu.backend": cpu_backend}


__all__ = [
    "ApiConfig",
    "Config",
    "ConfigError",
    "CpuConfig",
    "DaemonConfig",
    "GpuConfig",
    "HttpConfig",
    "SchedSection",
    "ServiceConfig",
    "SimulatedGpuConfig",
    "cli_overrides",
    "default_socket",
    "default_state_dir",
    "format_cores",
    "integer",
    "load_config",
    "load_config_with",
    "number",
    "parse_cores",
    "parse_size",
    "resolve_user",
    "setting",
    "size",
]
