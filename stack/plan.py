"""The resource plan with the services' own settings: each service's configuration loaded as it
will load it (services/<name>/config.py), its `threads`, `cpus` and `device` handed to the pure
plan in common/resources.py as overrides and hints.  Here, above the services, because it loads
their config modules; the services themselves only use common/resources.py."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence

from common import resources
from common.config import load


def service_settings(service: str, argv: Sequence[str] = (), env: dict | None = None):
    """A service's configuration as it will load it (YAML < env < argv): its `threads`, `cpus`
    and `device` are the plan's overrides and hints."""
    mod = importlib.import_module(f"services.{service}.config")
    cls = next(v for k, v in vars(mod).items() if k.lower() == f"{service}config")
    return load(cls, service, list(argv), env)


def plan_services(services: Sequence[str], argv: dict[str, Sequence[str]] | None = None,
                  env: dict | None = None, cpus: Iterable[int] | None = None
                  ) -> tuple[list[int], dict[str, resources.Share]]:
    """The plan for these services on this machine, with their configured overrides."""
    cores = list(cpus) if cpus is not None else resources.usable_cpus()
    threads, pinned, gpu = {}, {}, set()
    for name in services:
        cfg = service_settings(name, (argv or {}).get(name, ()), env)
        threads[name] = cfg.threads
        if cfg.cpus:
            pinned[name] = resources.parse_cpus(cfg.cpus)
        if str(getattr(cfg, "device", "cpu")).startswith("cuda"):
            gpu.add(name)
    return cores, resources.plan(cores, services, gpu=gpu, threads=threads, pinned=pinned)
