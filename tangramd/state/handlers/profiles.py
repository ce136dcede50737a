"""Elasticity profiles (``tangramctl profile --save``): a command's speed-up per DoP,
which an exec names with ``profile=`` instead of giving ``t1_s`` and ``eff``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.model import InvalidDemand
from tangramd import events as ev
from tangramd.state.dispatch import handles

if TYPE_CHECKING:
    from tangramd.state.context import Core


@handles(ev.SaveProfile)
def save_profile(core: Core, e: ev.SaveProfile, now: float, out: list[ev.Command]) -> None:
    prof = {k: e.profile.get(k) for k in ("dop", "t1_s", "eff", "speedup", "elastic")}
    if not prof["dop"] or prof["t1_s"] is None or not prof["eff"]:
        raise InvalidDemand("profile", "needs dop, t1_s and eff")
    prof["elastic"] = bool(prof["elastic"] if prof["elastic"] is not None else True)
    previous = core.profiles.get(e.name)
    core.profiles[e.name] = prof
    out.append(
        ev.PersistProfiles(
            profiles=dict(core.profiles), changed=(e.name, previous), cause=core.stimulus
        )
    )
    if e.token is not None:
        out.append(core.reply(e.token, result={"name": e.name, "saved": True}))


@handles(ev.ProfileUnsaved)
def profile_unsaved(core: Core, e: ev.ProfileUnsaved, now: float, out: list[ev.Command]) -> None:
    if e.previous is None:
        core.profiles.pop(e.name, None)
    else:
        core.profiles[e.name] = dict(e.previous)


@handles(ev.ProfilesLoaded)
def profiles_loaded(core: Core, e: ev.ProfilesLoaded, now: float, out: list[ev.Command]) -> None:
    for name, prof in e.profiles.items():
        core.profiles.setdefault(name, dict(prof))
