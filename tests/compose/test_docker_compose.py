"""compose/docker-compose.yml names modules of this package; each must exist, read without Docker.

The file is only ever run by docker-compose, which no test without an engine starts, so a module
renamed in the package (the namespace move turned ``compose.broker_entrypoint`` into
``rollout_journal.compose.broker.entrypoint``) would go unnoticed until every node reported
unhealthy. Here the YAML is parsed and each ``python3 -m X`` resolved against the repository.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from rollout_journal.compose.broker.image import _SCRIPTS as IMAGE_SCRIPTS
from tests.support.paths import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "compose" / "docker-compose.yml"
PACKAGE = "rollout_journal"
# `python3 -m X` in prose: the comments that tell a reader how to build the image.
RUN_MODULE = re.compile(r"python3? -m ([\w.]+)")


def module_file(module: str) -> Path | None:
    """Where ``module`` lives in the checkout (rollout_journal.compose.broker.entrypoint ->
    compose/broker/entrypoint.py), or None where no such file is."""
    head, _, rest = module.partition(".")
    if head != PACKAGE or not rest:
        return None
    path = REPO_ROOT.joinpath(*rest.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def commands(node: Any) -> list[list[str]]:
    """Every exec-form command list in the parsed YAML (a healthcheck's ``test``, a ``command``)."""
    if isinstance(node, dict):
        return [c for value in node.values() for c in commands(value)]
    if isinstance(node, list):
        if node and all(isinstance(item, str) for item in node):
            return [node]
        return [c for item in node for c in commands(item)]
    return []


def run_modules(command: list[str]) -> list[str]:
    return [command[i + 1] for i in range(len(command) - 1) if command[i] == "-m"]


def test_every_module_the_compose_file_runs_exists_in_the_package() -> None:
    spec = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    services = spec["services"]
    assert services, "the compose file defines no services"
    in_image = []
    for name, service in services.items():
        modules = [m for c in commands(service) for m in run_modules(c)]
        assert modules, f"{name} runs no `python3 -m` health check"
        in_image.extend((name, m) for m in modules)
    missing = [f"{name}: {module}" for name, module in in_image if module_file(module) is None]
    assert not missing, "the compose file runs modules the package lacks:\n" + "\n".join(missing)

    # The health check runs inside the broker image, which carries only compose/broker/'s scripts.
    broker = REPO_ROOT / "compose" / "broker"
    not_copied = [
        f"{name}: {module}"
        for name, module in in_image
        if (path := module_file(module)) is not None and (path.parent != broker or path.name not in IMAGE_SCRIPTS)
    ]
    assert not not_copied, "the broker image does not carry:\n" + "\n".join(not_copied)


def test_every_module_the_compose_file_tells_a_reader_to_run_exists() -> None:
    named = RUN_MODULE.findall(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert named, "the compose file no longer says how to build the image"
    missing = [module for module in named if module_file(module) is None]
    assert not missing, f"the compose file's comments name modules the package lacks: {missing}"
