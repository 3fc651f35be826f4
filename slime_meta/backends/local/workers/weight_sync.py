"""How the trainer's weights reach the teacher workers after a step: disk, shared memory or CUDA IPC.

`--weight-sync` picks the transfer (auto by default):
- disk: `save_pretrained` into the run's weights directory, then `/update_weights_from_disk` on
  every worker (SGLang's call; what any worker understands, also on another host).
- shared-memory: the trainer packs every tensor, in the worker's dtype, into one flat file under
  /dev/shm named with the process group's buffer prefix, and sends the table of names, shapes,
  dtypes and byte offsets (`/update_weights_from_shared_memory`); the workers copy in place.
- cuda-ipc: the same table over one flat CUDA buffer of the trainer exported once through torch's
  CUDA IPC (`/update_weights_from_cuda_ipc`); needs trainer and workers on the same physical GPU.
- auto: cuda-ipc when the trainer and every worker are on one and the same GPU, shared-memory when
  the workers were started by this run (on this host) otherwise, disk for workers that accept no
  same-host transfer or when /dev/shm has no room for the buffer (with a warning).

One buffer per run, rewritten at every push. The process group writes it under the lock its
supervisor holds while it gives a restarted worker the current weights, so a restarted worker
reads the current buffer whole, never half of the next version. The group removes every file
with its prefix when it stops (also on SIGTERM); a worker whose launching process died removes
them on its way out (SIGKILL of the trainer).

The version a pool serves is kept here too (`ServedWeights`, one per pool of the process group):
a push publishes, remembers the update with its version and loads it into every live worker
over HTTP; the group's supervisor loads the remembered update into a restarted worker before the
router sends it anything. A push reads: run -> `push_weights` -> `WeightSync.push` ->
`ServedWeights.push` -> each worker's weight-update route.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from slime_meta.backends.local.workers.local_http import http_json
from slime_meta.config.arguments import MetaConfig
from slime_meta.errors import UserInputError
from slime_meta_engine.weights import SHARED_MEMORY_DIR, gpu_uuid

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MODES = ("auto", "disk", "shared-memory", "cuda-ipc")
_ALIGNMENT_BYTES = 256  # every tensor starts on a boundary any dtype's view accepts


@dataclass(frozen=True)
class WeightUpdate:
    """One weight-update call: the worker endpoint and its body (the version is added per call)."""

    endpoint: str
    body: dict[str, Any] = field(compare=False)
    description: str = ""

    def __str__(self) -> str:
        return self.description or self.endpoint


def disk_update(model_path: str) -> WeightUpdate:
    return WeightUpdate("/update_weights_from_disk", {"model_path": model_path}, model_path)


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point state, each storage once (a tied head is the embeddings)."""
    tensors, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
    return tensors


def flat_layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[list[dict[str, Any]], int]:
    """The table sent to the workers (byte offsets into one buffer) and the buffer's size in bytes."""
    entries, offset = [], 0
    element_size = torch.empty(0, dtype=dtype).element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    for name, tensor in tensors.items():
        entries.append({"name": name, "shape": list(tensor.shape), "dtype": dtype_name, "offset": offset})
        offset += -(-tensor.numel() * element_size // _ALIGNMENT_BYTES) * _ALIGNMENT_BYTES
    return entries, max(offset, _ALIGNMENT_BYTES)


def _pack(
    flat_bytes: torch.Tensor, tensors: dict[str, torch.Tensor], entries: list[dict[str, Any]], dtype: torch.dtype
) -> None:
    element_size = torch.empty(0, dtype=dtype).element_size()
    with torch.no_grad():
        for entry, tensor in zip(entries, tensors.values()):
            start = entry["offset"]
            target = flat_bytes[start : start + tensor.numel() * element_size]
            # Cast on the trainer's device first: the transfer to the buffer then moves the smaller dtype.
            target.view(dtype).view(tensor.shape).copy_(tensor.detach().to(dtype))


class SharedMemoryBuffer:
    """One flat file under /dev/shm, mapped for the trainer's lifetime and rewritten at every push."""

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.path = Path(SHARED_MEMORY_DIR) / name
        self.entries, self.size = flat_layout(tensors, dtype)
        size = self.size
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, size)  # out of /dev/shm space fails here, not as SIGBUS later
            self._mapped = mmap.mmap(descriptor, size, access=mmap.ACCESS_WRITE)
        except OSError:
            os.close(descriptor)
            self.path.unlink(missing_ok=True)
            raise
        os.close(descriptor)
        self._flat = torch.frombuffer(self._mapped, dtype=torch.uint8)

    def publish(self, tensors: dict[str, torch.Tensor]) -> WeightUpdate:
        _pack(self._flat, tensors, self.entries, self.dtype)
        body = {"buffer_name": self.name, "tensors": self.entries}
        return WeightUpdate("/update_weights_from_shared_memory", body, f"shared memory {self.name}")

    def close(self) -> None:
        self._flat = None
        self._mapped.close()
        self.path.unlink(missing_ok=True)


class CudaIpcBuffer:
    """One flat CUDA buffer on the trainer's GPU, exported once; it lives as long as the trainer."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        import base64

        from torch.multiprocessing.reductions import reduce_tensor

        self.dtype, self.device = dtype, device
        self.entries, self.size = flat_layout(tensors, dtype)
        size = self.size
        self._flat = torch.empty(size, dtype=torch.uint8, device=device)
        _, fields = reduce_tensor(self._flat)
        (_, _, _, _, _, _, _, handle, storage_size, storage_offset, _, ref_handle, ref_offset, event, event_sync) = (
            fields
        )
        encode = lambda raw: None if raw is None else base64.b64encode(raw).decode()  # noqa: E731
        self.descriptor = {
            "gpu_uuid": gpu_uuid(device),
            "handle": encode(handle),
            "storage_size_bytes": int(storage_size),
            "storage_offset_bytes": int(storage_offset),
            "ref_counter_handle": encode(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": encode(event),
            "event_sync_required": bool(event_sync),
        }
        if storage_size < size:
            raise RuntimeError(f"CUDA IPC export of a {size}-byte buffer gave a {storage_size}-byte storage")

    def publish(self, tensors: dict[str, torch.Tensor]) -> WeightUpdate:
        _pack(self._flat, tensors, self.entries, self.dtype)
        torch.cuda.synchronize(self.device)  # the workers read on their own streams
        body = {"ipc_buffer": self.descriptor, "tensors": self.entries}
        return WeightUpdate("/update_weights_from_cuda_ipc", body, "a CUDA IPC buffer")

    def close(self) -> None:
        self._flat = None


def transfer_info(worker_url: str) -> dict[str, Any] | None:
    """What a worker accepts (`/weight_transfer_info`); None for a worker without same-host transfers."""
    try:
        with urllib.request.urlopen(worker_url.rstrip("/") + "/weight_transfer_info", timeout=30) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def choose_mode(requested: str, trainer_device: torch.device, infos: list[dict[str, Any] | None]) -> str:
    """The transfer for these workers; a mode they cannot take is the user's error (--weight-sync)."""
    if requested == "disk":
        return "disk"
    ours = all(info and info.get("buffer_prefix") for info in infos)
    if not ours:
        if requested == "auto":
            return "disk"
        raise UserInputError(
            f"--weight-sync {requested}: the teacher workers do not accept same-host transfers; use auto or disk"
        )
    trainer_gpu = gpu_uuid(trainer_device)
    same_gpu = trainer_gpu is not None and all(info.get("gpu_uuid") == trainer_gpu for info in infos)
    if requested == "cuda-ipc" and not same_gpu:
        raise UserInputError(
            "--weight-sync cuda-ipc needs the trainer and every teacher worker on one and the same GPU "
            f"(trainer on {trainer_device}, workers on {sorted({str(i.get('device')) for i in infos})}); "
            "use auto or shared-memory"
        )
    if requested == "auto":
        return "cuda-ipc" if same_gpu else "shared-memory"
    return requested


class WeightTarget(Protocol):
    """A worker a push reaches: its URL, a name for messages, and whether its process is up."""

    url: str
    role: str

    def serving(self) -> bool:
        """Up and not restarting: it takes the update now (else it gets it when it is back)."""

    def exited(self) -> bool:
        """Its process has ended: a failed call was its death, not a refusal."""


@dataclass(frozen=True)
class RemoteWorker:
    """A worker this process did not start (no process to watch): taken to be up."""

    url: str

    @property
    def role(self) -> str:
        return f"worker {self.url}"

    def serving(self) -> bool:
        return True

    def exited(self) -> bool:
        return False


def load_update(url: str, update: WeightUpdate, version: str) -> None:
    """One worker's weight-update call; RuntimeError when it refuses (URLError/OSError when it is gone)."""
    status, reply = http_json("POST", url + update.endpoint, {**update.body, "weight_version": version}, 600.0)
    if status != 200 or not (reply or {}).get("success"):
        raise RuntimeError(f"weight update of {url} failed: {(reply or {}).get('message', status)}")


class ServedWeights:
    """What a pool's workers serve: the last weight update and its version.

    A push remembers the update first, then loads it into every worker that is up; a worker that
    is down or restarting is skipped and loads `current` when it is back (the process group's
    supervisor calls `load_current` under `lock` before the router sends it anything). `lock` is
    the process group's: no restarted worker reads a buffer while a push rewrites it.
    """

    def __init__(self, workers: Sequence[WeightTarget], lock: threading.RLock | None = None):
        self.workers = tuple(workers)
        self.lock = lock if lock is not None else threading.RLock()
        self.current: tuple[WeightUpdate, str] | None = None

    @classmethod
    def of_urls(cls, urls: Sequence[str]) -> ServedWeights:
        return cls([RemoteWorker(url.rstrip("/")) for url in urls])

    @property
    def version(self) -> str | None:
        return self.current[1] if self.current is not None else None

    def load_current(self, worker: WeightTarget) -> None:
        update, version = self.current
        load_update(worker.url, update, version)

    def push(self, update: WeightUpdate | Callable[[], WeightUpdate], version: str | int) -> list[str]:
        """Remember `update` (or what the function returns, called under the lock) as weights
        `version` and load it into every worker that is up; the URLs updated now. RuntimeError when
        a live worker refuses it (the previous update is then kept for restarts)."""
        with self.lock:
            update = update() if callable(update) else update
            previous, self.current = self.current, (update, str(version))
            updated = []
            try:
                for worker in self.workers:
                    if not worker.serving():
                        logger.warning("%s is down: it gets weights %s when it is back", worker.role, version)
                        continue
                    try:
                        self.load_current(worker)
                    except (urllib.error.URLError, OSError) as error:
                        if not worker.exited():
                            time.sleep(0.2)  # a worker dying right now: let its exit show
                        if worker.exited():
                            logger.warning(
                                "%s died during a weight update: it gets the weights when it is back", worker.role
                            )
                            continue
                        raise RuntimeError(f"weight update of {worker.url} failed: {error}") from None
                    updated.append(worker.url)
            except RuntimeError:
                # A refused update is not what restarted workers should load (a shared buffer holds
                # the refused weights by now, but the run stops on this error anyway).
                self.current = previous
                raise
            return updated


class WeightSync:
    """The run's transfer: publishes the trainer's weights for one push; `close()` frees its buffer."""

    def __init__(self, mode: str, weights_root: Path, buffer: SharedMemoryBuffer | CudaIpcBuffer | None = None):
        self.mode, self.weights_root, self.buffer = mode, weights_root, buffer

    def push(self, trainer, version: int, served: ServedWeights) -> None:
        """Publish the trainer's weights as `version` and load them into the workers of `served`.

        The publication runs under the served pool's lock, so a restarted worker never reads a
        half-written buffer. Older weight directories are removed once every worker has moved on.
        """
        update = None

        def publish() -> WeightUpdate:
            nonlocal update
            update = self.publish(trainer, version)
            return update

        served.push(publish, version)
        self.after_push(update)

    def publish(self, trainer, version: int) -> WeightUpdate:
        if self.buffer is None:
            directory = trainer.save_weights(self.weights_root / f"v{version:07d}")
            return disk_update(str(directory.resolve()))
        return self.buffer.publish(unique_tensors(trainer.model))

    def after_push(self, update: WeightUpdate) -> None:
        """Older weight directories go once every worker has moved on."""
        if self.buffer is None:
            for old in self.weights_root.glob("v*"):
                if str(old.resolve()) != update.body["model_path"]:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()


def make_weight_sync(requested: str, trainer, worker_urls, weights_root: Path, buffer_prefix: str | None) -> WeightSync:
    """Ask the workers what they accept, pick the transfer and allocate its buffer once."""
    infos = [transfer_info(url) for url in worker_urls] if requested != "disk" else []
    mode = choose_mode(requested, trainer.device, infos)
    if mode != "disk" and (buffer_prefix is None or any(info["buffer_prefix"] != buffer_prefix for info in infos)):
        if requested != "auto":
            raise UserInputError(
                f"--weight-sync {requested}: the teacher workers were not started by this run; use auto or disk"
            )
        mode = "disk"
    if mode == "disk":
        return WeightSync("disk", weights_root)
    tensors = unique_tensors(trainer.model)
    dtype = getattr(torch, infos[0]["dtype"])
    if mode == "cuda-ipc":
        return WeightSync(mode, weights_root, CudaIpcBuffer(tensors, dtype, trainer.device))
    try:
        return WeightSync(mode, weights_root, SharedMemoryBuffer(f"{buffer_prefix}-weights", tensors, dtype))
    except OSError as error:
        if requested != "auto":
            raise UserInputError(
                f"--weight-sync shared-memory: cannot make the buffer in {SHARED_MEMORY_DIR} ({error}); use disk"
            ) from None
        logger.warning("no shared-memory buffer for the weights (%s): pushing them through the disk", error)
        return WeightSync("disk", weights_root)


def weight_sync_for_run(cfg: MetaConfig, trainer, worker_urls, weights_root: Path, buffer_prefix: str) -> WeightSync:
    """The run's weight transfer (--weight-sync), its buffer allocated once; the caller closes it."""
    sync = make_weight_sync(cfg.train.weight_sync, trainer, worker_urls, weights_root, buffer_prefix)
    print(f"weights reach the teacher workers through {sync.mode} (--weight-sync {cfg.train.weight_sync})", flush=True)
    return sync


def push_weights(trainer, worker_urls: list[str], weights_root: Path, version: int, processes=None, sync=None) -> None:
    """Publish the trainer's weights and load them into every teacher worker.

    `sync` (the run's `WeightSync`) picks the transfer; without one, the weights go through the
    disk. The router does not forward weight updates, so each worker is called directly (as slime
    does). With `processes` (the run's LocalProcessGroup) the teacher pool's `ServedWeights` it
    holds are updated: a worker that is down or restarting is skipped and loads the same weights
    when the supervisor brings it back (never the starting checkpoint next to trained workers).
    """
    sync = sync if sync is not None else WeightSync("disk", weights_root)
    served = processes.served_weights("teacher") if processes is not None else ServedWeights.of_urls(worker_urls)
    sync.push(trainer, version, served)
