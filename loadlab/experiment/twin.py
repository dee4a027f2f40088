"""A sweep's runs in virtual time (``--virtual``): each run on the twin's simulated clock, in this process
(`loadlab.virtual.run_virtual`), writing the same run directory a real run writes.

The server a configuration would launch becomes twin settings: a launch template that runs the twin
(``loadlab sim ...``, or ``python -m loadlab sim ...``) is read flag by flag with the twin's own settings
table, its placeholders filled as for a launch, so virtual and real time run the same server. Any other
template (real SGLang) has no twin to read: its server axes must then be twin settings by name
(``max_running_requests``, docs/sim.md), laid over the profile's ``target.embedded``. Without a
template the profile's target runs (``target.embedded``, or its ``target.cluster`` with the cluster axes).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loadlab.experiment.spec import SweepError, SweepSpec, run_sets
from loadlab.profile import Profile, ProfileError, load_profile, parse_set_option
from loadlab.sim import settings as twin
from loadlab.virtual import run_virtual


def twin_arguments(launch: tuple[str, ...] | None) -> list[str] | None:
    """The twin's flags in a launch template that runs ``loadlab sim``, or None for any other server."""
    argv = list(launch or ())
    if len(argv) >= 2 and Path(argv[0]).name == "loadlab" and argv[1] == "sim":
        return argv[2:]
    if len(argv) >= 4 and argv[1:4] == ["-m", "loadlab", "sim"]:  # python -m loadlab sim
        return argv[4:]
    return None


def run_profile(spec: SweepSpec, config: dict[str, Any], sets: list[str], warm_up: bool) -> Profile:
    """The profile a run of ``config`` uses: the sweep's ``set:``, its dotted axes, the SLO, then
    ``sets`` (a capacity search's load and seed), as `loadlab run` would get them with ``--set``."""
    items = run_sets(spec, config) + [f"slo.{k}={v}" for k, v in spec.slo.items()] + list(sets)
    if not warm_up:
        items.append("requests.warmup=0")
    try:
        return load_profile(spec.profile, dict(parse_set_option(item) for item in items))
    except ProfileError as e:
        raise SweepError(f"{spec.file}: {e}") from None


def virtual_settings(spec: SweepSpec, config: dict[str, Any], profile: Profile) -> dict[str, Any]:
    """The twin's settings for ``config`` in virtual time (see the module's docstring); a server axis the
    twin cannot take is one ``SweepError`` line."""
    server = {axis: value for axis, value in config.items() if "." not in axis}
    flags = twin_arguments(spec.launch)
    if flags is not None:
        fill = {**{a: str(v) for a, v in server.items()}, "port": "0"}
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        twin.add_arguments(parser, suppress_defaults=True)
        try:
            given, unknown = parser.parse_known_args([a.format(**fill) for a in flags])
        except argparse.ArgumentError as e:
            raise SweepError(f"{spec.file}: launch: {e}") from None
        if unknown:
            raise SweepError(f"{spec.file}: launch: {unknown[0]}: not a setting of the twin, so not in virtual "
                             "time (its flags: loadlab sim --help)")  # fmt: skip
        return {k: v for k, v in vars(given).items() if k not in twin.PROCESS_SETTINGS}
    settings = {} if profile.target.cluster else dict(profile.target.embedded)
    for axis, value in server.items():
        if axis not in twin.BY_NAME or not twin.BY_NAME[axis].embedded:
            raise SweepError(f"{spec.file}: axes: {axis}: in virtual time a server axis is a twin setting "
                             "(docs/sim.md, e.g. max_running_requests): the launch template is not loadlab sim")  # fmt: skip
        settings[axis] = value
    problem = twin.check_embedded_settings(settings)
    if problem:
        raise SweepError(f"{spec.file}: axes: {problem}")
    return settings


def check_virtual(spec: SweepSpec, configs: list[dict[str, Any]]) -> None:
    """Every configuration can run in virtual time (raises the first problem), before anything runs."""
    for config in configs:
        virtual_settings(spec, config, run_profile(spec, config, [], True))


def virtual_run(
    spec: SweepSpec, out: Path, name: str, config: dict[str, Any], sets: list[str], warm_up: bool, html: bool
) -> Path:
    """One run of ``config`` in virtual time into ``out/runs/name``; returns its run directory."""
    profile = run_profile(spec, config, sets, warm_up)
    return run_virtual(
        profile,
        virtual_settings(spec, config, profile),
        out / "runs",
        name,
        profile_path=spec.profile,
        command=["loadlab", "sweep", spec.file, "--virtual"],
        cluster=profile.target.cluster,
        cluster_overrides=profile.target.cluster_overrides or None,
        html=html,
    )
