"""``ddpwatch doctor``: pre-flight checks before a launch (``ddpwatch/doctor/``)."""

from __future__ import annotations

import argparse

from ddpwatch.commands._args import Subparsers, _addr, _positive, _positive_int

NAME = "doctor"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    doctor = subparsers.add_parser(
        NAME, help="pre-flight checks to run before a launch; exit 1 if one fails"
    )
    doctor.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=_positive_int,
        default=None,
        metavar="N",
        help="ranks per node, as given to torchrun (default: $LOCAL_WORLD_SIZE)",
    )
    doctor.add_argument(
        "--nnodes",
        default=None,
        metavar="N",
        help="nodes, as given to torchrun (default: $PET_NNODES, else 1): on one node torchrun "
        "picks a free rendezvous port unless --master-port is given",
    )
    doctor.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_positive_int,
        default=None,
        metavar="PORT",
        help="the port given to torchrun (default: $PET_MASTER_PORT); $MASTER_PORT is checked "
        "for a launch that reads it (mp.spawn, srun), torchrun never does",
    )
    doctor.add_argument(
        "--standalone",
        action="store_true",
        default=None,
        help="the job runs torchrun --standalone (a c10d rendezvous on a free port)",
    )
    doctor.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="the job's backend (default: nccl when CUDA is available, else gloo); gloo on a "
        "machine without an NVIDIA GPU is a CPU job: no NVML or driver is needed, GPU checks "
        "are skipped",
    )
    doctor.add_argument(
        "--addr",
        type=_addr,
        default=None,
        metavar="HOST:PORT",
        help="the ddpwatch serve to probe (default: where the ranks report: $DDPWATCH_ADDR, "
        "else $MASTER_ADDR:5599)",
    )
    doctor.add_argument(
        "--curve-server-key",
        default=None,
        metavar="KEY|FILE",
        help="the server's CurveZMQ public key, or its .key file (default: $DDPWATCH_SERVER_KEY)",
    )
    doctor.add_argument(
        "--curve-client-key-file",
        default=None,
        metavar="FILE",
        help="this client's .key_secret file (default: $DDPWATCH_CLIENT_KEY_FILE)",
    )
    doctor.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds to wait for the server (default 2)"
    )
    return doctor


def run(args: argparse.Namespace) -> int:
    from ddpwatch.doctor import doctor_main

    return doctor_main(args)
