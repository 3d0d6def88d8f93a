"""Synthetic ranks with simulated GPUs, published over the real wire protocol.

They show what a CPU machine cannot: two ranks on one GPU, a rank that used its
global rank as a device ordinal, uneven memory and a foreign process on a GPU.
Every message carries ``simulated=True`` and the views label such ranks.
No torch needed.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any

import zmq

from ddpwatch.core.protocol import PROTOCOL_VERSION, ErrorInfo, Event, Hello, Sample, encode
from ddpwatch.core.vocabulary import EventKind

GIB = 1 << 30
GPUS_PER_HOST = 8
GPU_TOTAL = 80 * GIB
STEP_TIME_S = 0.2
SIM_PID_BASE = 900_000
FOREIGN_PID = 424_242
# which simulated rank (by index) shows which fault
SHARES_GPU_1 = 2  # uses the GPU of local rank 1: two ranks on one GPU
UNEVEN = 3  # holds far more memory than the others
FOREIGN = 5  # its GPU also holds a process from outside the job


class SimulatedCluster:
    """Publishes ``count`` simulated ranks, numbered from ``first_rank``, every ``interval``."""

    def __init__(
        self, endpoint: str, count: int, first_rank: int = 0, interval: float = 0.5
    ) -> None:
        self.endpoint = endpoint
        self.count = count
        self.first_rank = first_rank
        self.interval = interval
        self.world_size = first_rank + count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpwatch-simulate", daemon=True)
        self._started = time.time()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _local(self, index: int) -> tuple[str, int]:
        return f"sim-node-{index // GPUS_PER_HOST}", index % GPUS_PER_HOST

    def _misplaced(self) -> int | None:
        """The rank that called ``set_device(global rank)``.

        After real ranks (a mixed demo) its global rank is a GPU that exists on its
        host, so it silently runs on the wrong one; alone, the first rank of the
        second host asks for a GPU that does not exist and crashes.
        """
        if self.first_rank == 0:
            return GPUS_PER_HOST if self.count > GPUS_PER_HOST else None
        for index in range(self.count):
            rank, local = self.first_rank + index, index % GPUS_PER_HOST
            if (
                rank < GPUS_PER_HOST
                and rank != local
                and index not in (SHARES_GPU_1, UNEVEN, FOREIGN)
            ):
                return index
        return None

    def _crashed(self, index: int) -> bool:
        return self.first_rank == 0 and index == self._misplaced()

    def _gpu(self, index: int) -> int:
        if index == self._misplaced():
            return self.first_rank + index
        return 1 if index == SHARES_GPU_1 else index % GPUS_PER_HOST

    def sample(self, index: int, now: float) -> Sample:
        host, _ = self._local(index)
        gpu = self._gpu(index)
        elapsed = now - self._started
        step = int(elapsed / STEP_TIME_S)
        used = int((30 + 2 * math.sin(index)) * GIB)
        if index == UNEVEN:
            used = 76 * GIB
        pids = [
            SIM_PID_BASE + self.first_rank + i
            for i in range(self.count)
            if self._shares(i, host, gpu)
        ]
        if index == FOREIGN:
            pids.append(FOREIGN_PID)  # a leftover process from another job
        return Sample(
            **self._identity(index, now),
            backend="nccl",
            device=f"cuda:{gpu}",
            device_index=gpu,
            device_name="Simulated H100 80GB",
            device_uuid=f"GPU-5151{index // GPUS_PER_HOST:04x}-0000-4000-8000-{gpu:012x}",
            phase="forward" if step % 2 else "backward",
            step=step,
            loss=2.0 / (1.0 + 0.01 * step) + 0.01 * math.sin(index + step),
            step_time_s=STEP_TIME_S,
            avg_step_time_s=STEP_TIME_S,
            data_wait_s=0.004,
            collective_time_s=0.03,
            mem_allocated_bytes=used - 4 * GIB,
            mem_reserved_bytes=used - 2 * GIB,
            gpu_mem_used_bytes=used,
            gpu_mem_total_bytes=GPU_TOTAL,
            gpu_pids=pids,
        )

    def _identity(self, index: int, now: float) -> dict[str, Any]:
        """Who simulated rank ``index`` is: the fields every message of it repeats."""
        host, local = self._local(index)
        rank = self.first_rank + index
        return {
            "v": PROTOCOL_VERSION,
            "rank": rank,
            "t": now,
            "local_rank": local,
            "world_size": self.world_size,
            "local_world_size": GPUS_PER_HOST,
            "node_rank": index // GPUS_PER_HOST,
            "host": host,
            "pid": SIM_PID_BASE + rank,
            "launcher": "simulated",
            "device_count": GPUS_PER_HOST,
            "simulated": True,
        }

    def _shares(self, index: int, host: str, gpu: int) -> bool:
        return (
            not self._crashed(index) and self._local(index)[0] == host and self._gpu(index) == gpu
        )

    def crash(self, index: int, now: float) -> list[Hello | Event]:
        """A rank that died in ``set_device(rank)``: who it was, then its exception."""
        rank = self.first_rank + index
        hello = Hello(**self._identity(index, now))
        message = "CUDA error: invalid device ordinal"
        trace = (
            "Traceback (most recent call last):\n"
            '  File "train.py", line 31, in <module>\n'
            "    torch.cuda.set_device(rank)\n"
            f"RuntimeError: {message}\n"
        )
        crash = Event(
            v=PROTOCOL_VERSION,
            rank=rank,
            t=now,
            event=EventKind.CRASH,
            phase="device",
            error=ErrorInfo(type="RuntimeError", message=message, traceback=trace),
        )
        return [hello, crash]

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                now = time.time()
                for index in range(self.count):
                    messages = (
                        self.crash(index, now)
                        if self._crashed(index)
                        else [self.sample(index, now)]
                    )
                    for message in messages:
                        # a busy server drops a beat: the next one repeats it
                        with contextlib.suppress(zmq.Again):
                            sock.send(encode(message), zmq.NOBLOCK)
                self._stop.wait(self.interval)
        finally:
            sock.close()
