"""The Ray actor behind every rank: one process per rank, hosting that rank's worker (and, with
`rollout.colocate`, other roles' workers in the same process), joined in a torch.distributed group. Every
call returns the process's memory snapshot and the call's seconds beside its result (no extra round trip).
RayWorkerGroup (ray_backend.py) creates and calls these.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..data.packed import PackedTensors
from .channel import ChannelServer
from .errors import WorkerError
from .transport import SharedMemoryWriter, SharedTensors, pack


class Stashed:
    """A result kept in the producing actor for a role hosted in the same process (`rollout.colocate`)."""


def _preload() -> None:
    """What building a role's worker imports before its first line runs, paid by a warm process before a session
    takes it: transformers' auto classes (most of its import) and the model code of the architectures this
    project ships and tests (Llama, Qwen2)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401


class WorkerActor:
    """Hosts one rank of one role, and of any role colocated with it (`rollout.colocate`: the rollout
    engine in the policy's processes). Plain class; `ray.remote` is applied in RayWorkerGroup."""

    def __init__(self, role: str | None = None, rank: int = 0, world: int = 1, seed: int = 0, num_threads: int = 0,
                 deterministic: bool = False, pool: str = "default", device: str = "auto"):
        """With `role`, this rank of it; without, a warm process (warm.py): the imports and nothing else, until a
        session takes it and calls `become`."""
        import torch  # noqa: F401 - the imports are most of a new process's start: paid here, once
        import transformers

        from .. import roles  # noqa: F401 - every role's module (a warm process builds any of them fast)
        transformers.logging.disable_progress_bar()  # one bar per actor per load is noise in a notebook
        self.workers: dict[str, Any] = {}  # role -> worker object; the actor's own role first
        self._shm: SharedMemoryWriter | None = None  # weights pushed to a consumer on this node
        self._stash: Any = None  # weights handed to a colocated role without leaving the process
        self.meta: dict = {}  # what a controller attaching later needs to find (e.g. the run directory)
        self._one_call = threading.Lock()  # a worker runs one call at a time, whether Ray or the channel brought it
        self._channel = ChannelServer(self.answer)  # calls from a controller on this machine (channel.py)
        self.role, self.rank, self.world, self.pool = role, rank, world, pool
        if role is not None:
            self.become(role, rank, world, seed, num_threads, deterministic, pool, device)
        else:
            _preload()

    def become(self, role: str, rank: int, world: int, seed: int, num_threads: int, deterministic: bool,
               pool: str = "default", device: str = "auto") -> None:
        """Take this rank's place: device, threads and seeds, as a process started for it would."""
        import random

        import torch

        from ..determinism import configure_process
        from ..roles.common import prefer_device
        prefer_device(device, pool)  # before any worker picks its device
        self.role, self.rank, self.world, self.pool = role, rank, world, pool
        configure_process(num_threads, deterministic)
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)

    def warm_status(self) -> dict:
        """pid and memory of a warm process (what `rlbench-nb up` reports it holds)."""
        from ..metrics.memory import memory_snapshot
        return {"pid": os.getpid(), **memory_snapshot()}

    def set_meta(self, meta: dict) -> None:
        self.meta = dict(meta)

    def get_meta(self) -> dict:
        return self.meta

    def address(self) -> tuple[str, int]:
        import socket

        import ray
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master: tuple[str, int] | None, worker_cls, args, kwargs, role: str | None = None) -> dict:
        role = role or self.role
        if master and self.world > 1:
            import torch
            import torch.distributed as dist
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world))
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=self.rank, world_size=self.world)
        try:
            self.workers[role] = worker_cls(*args, **kwargs)
        except Exception as e:
            raise WorkerError.from_exception(role, self.rank, "__init__", e) from None
        return self.info(role)

    def drop(self, role: str) -> None:
        """Close and forget a hosted role's worker (its own restart, or the session's close)."""
        worker = self.workers.pop(role, None)
        if hasattr(worker, "close"):
            worker.close()

    def info(self, role: str | None = None) -> dict:
        """Where this rank runs. Several Ray nodes can share one machine (one IP): `node_id` tells them apart."""
        import ray
        worker = self.workers.get(role or self.role)
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "pool": self.pool,
                "node_id": ray.get_runtime_context().get_node_id(),
                "device": str(getattr(worker, "device", "cpu")), "dtype": getattr(worker, "dtype", None),
                "channel": self._channel.path}

    def call(self, role: str, method: str, *args, **kwargs):
        """(result, memory snapshot, seconds inside the method)."""
        from ..metrics.memory import memory_snapshot
        with self._one_call:
            args = tuple(self._arg(a) for a in args)
            t0 = time.perf_counter()
            try:
                result = getattr(self.workers[role], method)(*args, **kwargs)
            except Exception as e:
                raise WorkerError.from_exception(role, self.rank, method, e) from None
            return result, memory_snapshot(), time.perf_counter() - t0

    def answer(self, request: tuple):
        """A call that came over the channel: `call`, or with a transport named `call_stored`'s (result, status)."""
        where, role, method, args, kwargs = request
        if where is not None:
            return self.call_stored(role, method, *args, where=where, **kwargs)
        return self.call(role, method, *args, **kwargs)

    def _arg(self, a):
        if isinstance(a, Stashed):
            a, self._stash = self._stash, None
        return a.unpack() if isinstance(a, (PackedTensors, SharedTensors)) else a

    def call_stored(self, role: str, method: str, *args, where: str = "store", **kwargs):
        """`call`, as two returns: the result, which the controller passes on by reference (bytes go from
        this process to the next one's, not through the controller), and the (None, memory, seconds)
        status. A dict of tensors goes as one flat buffer (`transport`): `where` = "store" (Ray's object
        store), "shm" (this node's shared memory) or "here" (kept for a role hosted in this process)."""
        result, mem, work_s = self.call(role, method, *args, **kwargs)
        if where == "here":
            self._stash = result
            return Stashed(), (None, mem, work_s)
        if isinstance(result, dict) and result and all(hasattr(v, "untyped_storage") for v in result.values()):
            if where == "shm" and self._shm is None:
                self._shm = SharedMemoryWriter(f"{role}{self.rank}")
            result = pack(result, self._shm if where == "shm" else None)
        return result, (None, mem, work_s)

    def close_worker(self) -> None:
        if self._shm is not None:
            self._shm.close()
        for role in list(self.workers)[::-1]:  # hosted roles first
            self.drop(role)
        self._channel.close()
