"""A script job's inputs on one node: its code package and input datasets fetched into the
node's caches, its pip environment built, its launch described."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchyard.contract.errors import SandboxUnavailableError
from worker.agent import sandbox
from worker.agent.api import retrying
from worker.agent.run_inputs import FETCH_DEADLINE_S
from worker.agent.script_launch import ScriptLaunch

if TYPE_CHECKING:
    from torchyard.contract.protocol import ScriptPlacement
    from worker.agent.context import AgentContext


def _link_tree(src: Path, dest: Path) -> None:
    """A copy of ``src`` made of hard links (a plain copy across file systems)."""
    tmp = dest.with_name(f".{dest.name}.part")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, tmp, copy_function=link)
    # The links share the cache's files: read-only, so a script does not change the
    # dataset under another job by writing into its input (it writes to its outputs).
    for root, _dirs, names in os.walk(tmp):
        for name in names:
            os.chmod(os.path.join(root, name), 0o444)
    os.replace(tmp, dest)


def prepare_script(
    ctx: AgentContext,
    work: ScriptPlacement,
    run_dir: Path,
    stop: threading.Event,
    logger: logging.Logger,
    *,
    agent_dir: Path | None = None,
) -> ScriptLaunch:
    """Fetch the code and the inputs into the node's caches, build the pip environment if
    asked for, and describe the launch."""
    from worker.agent.dataset_cache import fetch_dataset
    from worker.agent.pip_env import ensure_environment

    if work.spec.environment.network == "none" and ctx.sandbox != sandbox.BWRAP:
        raise SandboxUnavailableError(
            f"node {ctx.node_name} cannot give this job a network of its own (environment.network "
            f"none) without its sandbox: {sandbox.unavailable_reason() or 'it is turned off'}"
        )
    if ctx.sandbox == sandbox.UNAVAILABLE:
        raise SandboxUnavailableError(
            f"node {ctx.node_name} runs no script job without its sandbox: {sandbox.unavailable_reason()}; "
            f"install bubblewrap there, or start its agent with {sandbox.SANDBOX_VAR}=off to run scripts "
            "unconfined"
        )

    def fetch(what: str, url: str | None, ref_id: str, sha256: str, cache: Path) -> Path:
        started = time.monotonic()
        # A code package's files are at the top of its archive: no wrapping folder to unwrap.
        unwrap = url is None
        folder: Path = retrying(
            lambda: fetch_dataset(
                ctx.api.client, ref_id, sha256, cache, url=url, what=f"{what} {ref_id}", unwrap=unwrap
            ),
            f"fetching {what} {ref_id}",
            stop=stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        logger.info("%s %s ready in %.2f s", what, ref_id, time.monotonic() - started)
        return folder

    code_dir = fetch(
        "code package",
        f"/v1/worker/code/{work.code.id}/archive",
        work.code.id,
        work.code.sha256,
        ctx.work_dir / "code",
    )
    inputs: dict[str, Path] = {}
    for name, ref in work.inputs.items():
        cached = fetch("input dataset", None, ref.id, ref.sha256, ctx.dataset_cache)
        inputs[name] = run_dir / "inputs" / name
        inputs[name].parent.mkdir(parents=True, exist_ok=True)
        _link_tree(cached, inputs[name])
    spec = work.spec
    env_dir = None
    requirements = list(spec.environment.pip)
    if requirements:
        env_dir, built = ensure_environment(
            ctx.work_dir / "envs",
            requirements,
            stop=stop,
            on_build=logger,
            hidden=[ctx.work_dir],
            timeout_s=spec.environment.build_timeout_s,
        )
        logger.info("pip environment %s %s", env_dir.name, "built" if built else "reused")
    box = None
    if ctx.sandbox == sandbox.BWRAP:
        box = sandbox.Sandbox(
            writable=run_dir,
            hidden=[ctx.work_dir],
            read_only=[*inputs.values(), *([env_dir] if env_dir else [])],
            not_given=[run_dir / "inputs"],
        )
    return ScriptLaunch(
        run_dir=run_dir,
        node_name=ctx.node_name,
        node_rank=work.node_rank,
        node_count=work.node_count,
        nproc=work.process_count_per_node,
        master_addr=work.master_addr,
        master_port=work.master_port,
        cpus=ctx.cpus_for(work.process_count_per_node),
        command=tuple(spec.command),
        launch=spec.distribution.launch,
        variables=dict(spec.environment.variables),
        inputs=inputs,
        code_dir=code_dir,
        env_dir=env_dir,
        socket_ifname=ctx.socket_ifname,
        grace_s=ctx.grace_s,
        box=box,
        own_dir=agent_dir,
        network=spec.environment.network,
    )
