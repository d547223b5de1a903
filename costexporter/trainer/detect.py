"""Which rank this process is and which physical GPU it trains on, from the launcher's
environment (torchrun, SLURM, Open MPI) and NVML; and where its spool may live. The reporter
asks once, at start; nothing here runs on the training loop's path."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costexporter.store import keys, protocol
from costexporter.store.client import RedisClient

log = logging.getLogger("costexporter.client")


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return default


def detect_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun, SLURM or Open MPI variables."""
    rank = _env_int("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    return rank, local, world


@dataclass(frozen=True)
class GpuGuess:
    """Which physical GPU a rank trains on, and how that was found out (for its log line)."""

    index: int | None
    uuid: str | None
    source: str  # where the answer came from, in words
    problem: str | None = None  # why NVML could not say more (None: it did, or was not needed)


def detect_gpu(local_rank: int) -> tuple[int | None, str | None]:
    """This rank's physical GPU index and UUID, via CUDA_VISIBLE_DEVICES and NVML when present."""
    g = locate_gpu(local_rank)
    return g.index, g.uuid


def _visible_entry(local_rank: int) -> tuple[str | None, str]:
    """This rank's entry of CUDA_VISIBLE_DEVICES (None: not one), and where it came from. A
    process that sees one GPU uses it whatever its local rank (SLURM's per-task binding:
    `CUDA_VISIBLE_DEVICES=5` with `SLURM_LOCALID=1`); with several, the local rank picks one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank), f"local rank {local_rank} (CUDA_VISIBLE_DEVICES unset)"
    items = [x.strip() for x in visible.split(",") if x.strip()]
    if len(items) == 1:
        return items[0], f"CUDA_VISIBLE_DEVICES={visible!r}, the one GPU this process sees"
    if local_rank < len(items):
        return items[local_rank], f"CUDA_VISIBLE_DEVICES={visible!r}, entry {local_rank} (the local rank)"
    return None, f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {local_rank} (the local rank)"


def locate_gpu(local_rank: int) -> GpuGuess:
    """The physical GPU behind this rank's CUDA_VISIBLE_DEVICES entry: an index, a GPU UUID (or
    a unique prefix of one, as CUDA takes it) or a MIG device UUID, mapped through NVML to the
    physical index and UUID (a MIG device to the GPU that holds it: the agent samples that)."""
    entry, source = _visible_entry(local_rank)
    if entry is None:
        return GpuGuess(None, None, source)
    try:
        import pynvml
    except ImportError:
        return _without_nvml(entry, source, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError (no driver, no GPU), or a library that fails to load
        return _without_nvml(entry, source, f"NVML did not start: {e}")
    try:
        h = _nvml_handle(pynvml, entry)
        if h is None:
            return GpuGuess(None, None, source, f"NVML knows no GPU {entry!r}")
        is_mig = getattr(pynvml, "nvmlDeviceIsMigDeviceHandle", None)
        if is_mig is not None and entry.startswith("MIG-") and is_mig(h):
            h = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        index = int(pynvml.nvmlDeviceGetIndex(h))
        return GpuGuess(index, uuid.decode() if isinstance(uuid, bytes) else str(uuid), source)
    except Exception as e:  # noqa: BLE001 - an NVMLError on a lost or hidden GPU
        return _without_nvml(entry, source, f"NVML could not read GPU {entry!r}: {e}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_handle(pynvml: Any, entry: str) -> Any:
    """NVML's handle of an index, a UUID (full or a unique prefix) or a MIG device UUID."""
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        if entry.startswith("MIG-"):
            return None
    found = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        u = pynvml.nvmlDeviceGetUUID(h)
        if (u.decode() if isinstance(u, bytes) else str(u)).startswith(entry):
            found.append(h)
    return found[0] if len(found) == 1 else None


def _without_nvml(entry: str, source: str, problem: str) -> GpuGuess:
    """What the entry alone says: an index is the GPU's index (CUDA's order: set
    CUDA_DEVICE_ORDER=PCI_BUS_ID to be sure it is NVML's), a full GPU UUID is the GPU's UUID; a
    MIG device or a UUID prefix cannot be placed."""
    if entry.isdigit():
        return GpuGuess(int(entry), None, source, problem)
    if entry.startswith("GPU-") and len(entry) == 40:
        return GpuGuess(None, entry, source, problem)
    return GpuGuess(None, None, source, problem)


def default_spool_dir() -> Path:
    env = os.environ.get("COSTEXPORTER_SPOOL_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "costexporter" / "spool"


def writable_dir(path: Path) -> Path:
    for p in (path, Path(tempfile.gettempdir()) / f"costexporter-spool-{os.getuid()}"):
        try:
            p.mkdir(parents=True, exist_ok=True)
            if os.access(p, os.W_OK):
                return p
        except OSError:
            continue
    raise OSError(f"no writable spool directory ({path})")


_told_gpu = False


def tell_gpu(rank: int, host: str, index: int, guess: GpuGuess) -> None:
    """Without a UUID the agent can only match this rank by host + index: say what was found,
    from what, why no more, and how to do better (once a process)."""
    global _told_gpu
    if _told_gpu:
        return
    _told_gpu = True
    log.info(
        "costexporter: no GPU UUID for rank %d (%s); registering host %s GPU index %d (from %s). If "
        "that is not this rank's GPU, pass StepReporter(gpu_uuid=... or gpu_index=...) or set "
        "CUDA_VISIBLE_DEVICES; set COSTEXPORTER_HOST when hosts share a name",
        rank,
        guess.problem or "none found",
        host,
        index,
        guess.source,
    )


def say_shared_gpu(
    client: RedisClient, prefix: str, job: str, rank: int, host: str, gpu_uuid: str | None, gpu_index: int
) -> bool:
    """Say (and return True) when another rank of the job on this host names the same GPU
    (ranks without a local rank in their environment all take GPU 0). A read the ACL or Redis
    refuses says nothing."""
    try:
        ranks = client.hgetall(keys.ranks_key(prefix, job))
    except Exception:  # noqa: BLE001 - a check, never the reporter's failure
        return False
    for rank_s, raw in ranks.items():
        try:
            other = protocol.parse_registration(rank_s, raw)
        except protocol.RegistrationError:
            continue
        same_gpu = (other.gpu_uuid == gpu_uuid) if other.gpu_uuid and gpu_uuid else other.gpu == gpu_index
        if other.rank != rank and other.host == host and same_gpu:
            log.warning(
                "costexporter: ranks %d and %d of %s both name GPU %s of %s: its time is booked for "
                "one of them. Give each process its GPU (torchrun and srun set LOCAL_RANK / "
                "SLURM_LOCALID; or pass local_rank= or gpu_index= to StepReporter)",
                other.rank,
                rank,
                job,
                gpu_uuid or gpu_index,
                host,
            )
            return True
    return False
