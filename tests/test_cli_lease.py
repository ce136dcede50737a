"""`tangramctl lease renew|release` against a real `tangramd up` (issue 34 item 4): a lease
renewed from the CLI outlives its first TTL (one taken with it, not renewed, expires), and
`release` gives it back; bad input is a usage error naming the option."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from harness import running_daemon

from tangram.testing import wait_for
from tangramctl.main import cli


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("cli-lease")) as d:
        yield d


def ctl(sock: str, *args: str):
    return CliRunner().invoke(cli, ["--socket", sock, *args], catch_exceptions=False)


def test_lease_renew_outlives_the_first_ttl_and_release_gives_it_back(daemon):
    sock = daemon.socket
    with daemon.client() as c:
        renewed = c.acquire_lease("search", ttl_s=1.0)
        plain = c.acquire_lease("search", ttl_s=1.0)  # taken after it, same TTL
        r = ctl(sock, "lease", "renew", renewed, "--ttl", "60", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output) == {"lease_id": renewed, "ttl_s": 60.0, "state": "granted"}
        wait_for(lambda: c.story(plain)["outcome"] == "expired", 20, "the plain lease expired")
        story = c.story(renewed)
        assert story["state"] == "running" and story["outcome"] is None, story
        assert any(e["event"] == "renewed" for e in story["events"]), story

        r = ctl(sock, "lease", "renew", renewed, "--ttl", "30")
        assert (r.exit_code, r.output.strip()) == (0, f"{renewed}: granted, expires in 30 s")
        r = ctl(sock, "lease", "release", renewed, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output) == {"lease_id": renewed, "released": True, "state": "released"}
        assert c.story(renewed)["outcome"] == "ok"

        r = ctl(sock, "lease", "renew", plain, "--ttl", "5")  # expired: not found
        assert r.exit_code == 1 and "not_found" in r.output and plain in r.output
        r = ctl(sock, "lease", "release", "l999999")
        assert r.exit_code == 1 and "l999999" in r.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["renew", "l1"], "Missing option '--ttl'"),
        (["renew", "l1", "--ttl", "0"], "--ttl"),
        (["renew", "l1", "--ttl", "x"], "--ttl"),
    ],
)
def test_lease_renew_usage_errors_name_the_option(daemon, args, says):
    r = ctl(daemon.socket, "lease", *args)
    assert r.exit_code == 2 and says in r.output, r.output
