"""The hardening keys of the config (issue 9): parsed, defaulted, refused with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangramd.config import MIB, ConfigError, load_config, resolve_user


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tangram.toml"
    path.write_text(text)
    return path


def test_defaults():
    """Without a file the caps are on and commands run as the peer."""
    config = load_config(None, {})
    d = config.daemon
    assert (d.frame_timeout_s, d.max_connections, d.max_buffered_bytes) == (30.0, 4096, 256 * MIB)
    assert (d.allowed_uids, d.allowed_gids, config.cpu.exec_user) == ((), (), "peer")


def test_values_from_file(tmp_path):
    """Ids, sizes and the sandbox user are read and converted."""
    path = write(
        tmp_path,
        "[daemon]\nallowed_uids = [1001, 1000, 1000]\nallowed_gids = [50]\n"
        'max_buffered_bytes = "64MiB"\nframe_timeout_s = 2\n[cpu]\nexec_user = "nobody"\n',
    )
    config = load_config(path, {})
    assert config.daemon.allowed_uids == (1000, 1001)
    assert config.daemon.max_buffered_bytes == 64 * MIB
    assert config.cpu.exec_user == "nobody"
    assert resolve_user("nobody") == resolve_user(str(resolve_user("nobody")[0]))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nallowed_uids = [-1]\n", "daemon.allowed_uids"),
        ('[daemon]\nallowed_gids = ["wheel"]\n', "daemon.allowed_gids"),
        ("[daemon]\nmax_connections = 0\n", "daemon.max_connections"),
        ("[daemon]\nframe_timeout_s = 0\n", "daemon.frame_timeout_s"),
        ('[daemon]\nmax_buffered_bytes = "1"\n', "daemon.max_buffered_bytes"),
        ('[cpu]\nexec_user = "no-such-user-xyz"\n', "cpu.exec_user"),
    ],
    ids=["negative-uid", "gid-name", "zero-conns", "zero-frame-timeout", "tiny-buffer", "user"],
)
def test_bad_values_name_the_key(tmp_path, text, key):
    """A bad hardening value is a ConfigError naming its dotted key."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), {})
    assert info.value.key == key


def test_a_non_utf8_config_is_one_line_naming_the_file(tmp_path):
    """A config file that is not UTF-8 is a ConfigError saying so, never a traceback."""
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[daemon]\nsocket = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="not UTF-8 \\(byte 19\\)"):
        load_config(str(path), {})


def test_a_huge_gpu_memory_names_its_key(tmp_path):
    """`mem_gb = 1e308` (finite, but infinite in bytes) is a ConfigError on its key."""
    text = "[gpu.simulated]\ncount = 1\nmem_gb = 1e308\n"
    with pytest.raises(ConfigError, match="mem_gb: got 1e\\+308") as info:
        load_config(write(tmp_path, text), {})
    assert info.value.key == "gpu.simulated"
