"""``torchyard cluster`` and ``node drain|undrain``."""

from __future__ import annotations

import argparse

from torchyard.commands.common import _answer, _client, _print_json
from torchyard.terminal import (
    format_table,
    format_time,
)


def _cluster(args: argparse.Namespace) -> int:
    with _client(args) as client:
        cluster = client.cluster()
    if args.json:
        _print_json(cluster)
        return 0
    print(
        f"nodes ready: {cluster.ready_nodes}   max nodes: {cluster.max_nodes}   "
        f"max units per node: {cluster.max_units_per_node}"
    )
    rows = [
        (n.name, n.status, n.accelerator, n.units, n.free_units, n.address, format_time(n.last_heartbeat_at))
        for n in cluster.nodes
    ]
    print(format_table(["NODE", "STATUS", "ACCEL", "UNITS", "FREE", "ADDRESS", "HEARTBEAT"], rows))
    return 0


def _node_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node = client.drain_node(args.node)
    if args.json:
        _print_json(node)
    else:
        jobs = f"; preempted jobs: {', '.join(node.preempted_jobs)}" if node.preempted_jobs else ""
        print(f"node {node.name} {node.status}{jobs}")
    return 0


def _node_undrain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node = client.undrain_node(args.node)
    return _answer(args, node, f"node {node.name} {node.status}")


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``cluster`` and ``node``."""
    cluster = sub.add_parser("cluster", parents=[common], help="nodes, processing units and limits")
    cluster.set_defaults(handler=_cluster)

    node = sub.add_parser("node", help="drain or undrain a node (admin token)")
    node_sub = node.add_subparsers(dest="node_command", required=True)
    for verb, text in (
        ("drain", "take no new work; the node's jobs checkpoint and go back to the queue"),
        ("undrain", "make a drained node ready again"),
    ):
        cmd = node_sub.add_parser(verb, parents=[common], help=text)
        cmd.add_argument("node", metavar="NAME", help="node name or id")
        cmd.set_defaults(handler=_node_drain if verb == "drain" else _node_undrain)
