"""What every role's engine shares: its device, threads from its CPU share, its peak memory.

The device is a property of the base class so that no role can forget it: an engine given GPUs
puts its model and every batch on ``self.device``; one given none stays on the CPU.
"""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass

import torch

from rayppo.errors import RayppoError

LOG_FILE_ENV = "RAYPPO_LOG_FILE"
"""Set in an actor's environment by the driver: the file its stdout and stderr go to."""
CORES_ENV = "RAYPPO_CPU_CORES"
"""Set in an actor's environment by the driver from ``<role>.cores``: ``"0,1"``, the CPU cores
its process is pinned to."""


if os.environ.get(LOG_FILE_ENV):
    # First thing in the actor's process (this module is imported before any engine is built):
    # vLLM's, DeepSpeed's and transformers' output goes to the role's log file, not the terminal.
    from rayppo.console import redirect_output

    redirect_output(os.environ[LOG_FILE_ENV])

# Every role's process writes its threads' stacks to its log on SIGUSR1: the driver sends it to an
# actor that missed its deadline before replacing it (rayppo/cluster/supervisor.py).
try:
    if sys.__stderr__ is not None:  # None: no real stderr, nothing to dump to
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
except (AttributeError, ValueError, OSError):  # no real stderr here (a captured test run): nothing to dump to
    pass


class DeviceError(RayppoError, RuntimeError):
    """A role was given GPUs this process cannot use; the message names the role."""


def engine_device(gpus: float, role: str, cuda_available: bool | None = None,
                  visible: str | None = None, ray_gpu_ids: list[str] | None = None) -> torch.device:
    """The device of an engine that Ray gave ``gpus`` GPUs (a share of one counts).

    Ray sets ``CUDA_VISIBLE_DEVICES`` of an actor to the GPUs it assigned (ray 2.60,
    ``python/ray/_private/worker.py``, ``set_cuda_visible_devices``; for fractional shares too),
    so the actor's first GPU is ``cuda:0``. When a cluster disables that masking
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``) every GPU of the node is visible and the
    assigned one is ``ray.get_gpu_ids()[0]``, counted within the visible list. A role given GPUs where CUDA is unavailable is an
    error, not a silent fall-back to the CPU (which would run a 7B reference model on 1 thread).
    """
    if not gpus:
        return torch.device("cpu")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if not cuda_available:
        raise DeviceError(f"{role}: given {gpus:g} GPU(s) but this process sees no CUDA device "
                          f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible}); install a CUDA build "
                          f"of torch on that node, or set the role's GPUs to 0")
    if _ray_does_not_mask():
        ids = ray_gpu_ids if ray_gpu_ids is not None else _ray_gpu_ids()
        if ids:
            # Ray's ids are the node's (or the raylet's CUDA_VISIBLE_DEVICES entries); torch counts
            # the devices this process sees.
            listed = [] if visible == "<unset>" else visible.split(",")
            return torch.device("cuda", listed.index(ids[0]) if ids[0] in listed else int(ids[0]))
    return torch.device("cuda", 0)


def _ray_does_not_mask() -> bool:
    # Ray reads the variable as a boolean (ray/_common/utils.py, env_bool, 2.60).
    return os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "").lower() in ("1", "true")


def _ray_gpu_ids() -> list[str]:
    import ray

    return [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []


def pin_to_cores(cores: list[int], field: str) -> None:
    """Pin every thread of this process to ``cores`` (Linux); threads and processes it starts
    later (OpenMP pools, vLLM's engine core) inherit the mask.

    Every thread, not only the caller: ``sched_setaffinity(0, ...)`` sets the calling thread's
    mask alone, and Ray's and torch's threads already exist when an engine is built."""
    if not hasattr(os, "sched_setaffinity"):
        raise RayppoError(f"{field}: pinning to CPU cores needs Linux (sched_setaffinity); unset it")
    allowed = os.sched_getaffinity(0)
    if not set(cores) <= allowed:
        raise RayppoError(f"{field}: core(s) {sorted(set(cores) - allowed)} are not available to this process on "
                          f"this node (it may use {sorted(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended since the listing
            pass


@dataclass(frozen=True)
class Resources:
    """What a role's actor runs on, as the driver reserved it (the in-process trainer: its device)."""

    threads: int | None = None
    """torch intra-op threads: the actor's CPU share (``Engine.set_threads``); None: torch's default."""
    gpus: float = 0.0
    """GPUs Ray gave the actor (a fraction where roles share one; ``Engine.init_device``); 0: the CPU."""


class Engine:
    """Base of the role engines (generator, reference, reward, learner rank)."""

    device: torch.device = torch.device("cpu")
    """Where this engine's model and batches live (``init_device``)."""

    def init_device(self, gpus: float, role: str, make_current: bool = True) -> torch.device:
        """Select this engine's device from the GPUs Ray gave it (``engine_device``), and pin
        its process to the CPU cores of ``<role>.cores`` where set (``pin_to_cores``).

        ``make_current=False`` is for engines whose library places its own workers (vLLM, whose
        workers take ``cuda:<local rank>`` of what they see): no device is made current here,
        and where a cluster turned Ray's masking off, ``CUDA_VISIBLE_DEVICES`` is set to this
        actor's GPUs before anything touches CUDA, so those workers see only them."""
        if gpus and not make_current and _ray_does_not_mask() and _ray_gpu_ids():
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_ray_gpu_ids())
            os.environ.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
        if os.environ.get(CORES_ENV):
            pin_to_cores([int(c) for c in os.environ[CORES_ENV].split(",")], f"{role}.cores")
        self.device = engine_device(gpus, role)
        if self.device.type == "cuda" and make_current:
            torch.cuda.set_device(self.device)
        return self.device

    @staticmethod
    def set_threads(num_threads: int | None) -> None:
        """torch intra-op threads = the actor's CPU share (2 cores shared by 5 actors must not
        run 5 x 2 threads)."""
        if num_threads:
            torch.set_num_threads(num_threads)

    def peak_memory_bytes(self) -> dict[str, int]:
        """Peak resident memory of this process, and peak CUDA memory when on a GPU."""
        out = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = int(torch.cuda.max_memory_allocated())
        return out

    def release_cached_memory(self) -> int:
        """Hand the CUDA caching allocator's free blocks back to the device (colocated mode: vLLM
        wakes into that memory). Returns the bytes still reserved (0 off the GPU)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.ipc_collect()  # blocks shared by CUDA-IPC that the receiver has let go of
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(self.device))

    @staticmethod
    def process_id() -> tuple[int, str]:
        """``(pid, node address)`` of this engine's process."""
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def ready(self) -> tuple[str, float]:
        """Once the engine is built (the driver waits on it): what it holds, in one line, and
        the seconds since its process started."""
        return self.describe(), time.time() - _process_start()

    def describe(self) -> str:
        """``engine, device, threads, model``: overridden by each role."""
        return f"{type(self).__name__}, {self.device_info()}"

    def device_info(self) -> str:
        """``cpu, 2 threads`` or ``cuda:0 (NVIDIA H200)``."""
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        threads = torch.get_num_threads()
        return f"cpu, {threads} thread{'s' if threads != 1 else ''}"


def model_size(model: torch.nn.Module) -> str:
    """``1.2M params`` / ``494M params`` / ``7.6B params``."""
    n = sum(p.numel() for p in model.parameters())
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit} params"
    return f"{n} params"


def _process_start() -> float:
    """When this process started (Unix time)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil comes with Ray; without it, this module's import time
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
