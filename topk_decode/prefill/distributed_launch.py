"""The processes of a sequence-parallel prefill: spawned by `topk prefill --gpus N`, or started by torchrun.

`--gpus N`: this process is rank 0 (it reads the documents, loads the model, writes the cache and
draws the progress bar) and spawns ranks 1..N-1, which load the model, wait for the token ids, and
compute their share (prefill/distributed.py). Under `torchrun --nproc-per-node N -m topk_decode prefill`
the environment names the ranks instead; RANK 0 plays the same part. NCCL joins CUDA ranks (one GPU
each: cuda:LOCAL_RANK), gloo CPU ranks (`--device cpu`, for tests).

Failures: a spawned rank that dies ends rank 0's wait on the next collective (rank 0 watches its
processes while it waits), which then fails like any interrupted prefill (a resumable partial
directory is kept); rank 0 failing terminates the spawned ranks, and a spawned rank whose parent is
gone exits. Under torchrun, torchrun itself stops every rank when one fails.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.prefill.layerwise import CHUNK_SIZE

# Collectives may wait long legitimately (rank 0 tokenizing a million tokens, a layer of a slow CPU
# prefill); a dead peer is noticed by watching processes (or by torchrun), not by this timeout.
GROUP_TIMEOUT = timedelta(hours=6)
STOP_WAIT_S = 30.0  # how long rank 0 tries to tell waiting torchrun ranks that it failed
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load the same model as rank 0 (the token ids come later, from rank 0)."""

    model_dir: str
    dtype: str | None
    chunk_size: int
    offload_weights: bool = False


@dataclass(frozen=True)
class GroupPlan:
    """How this process takes part in a multi-process prefill."""

    world: int
    rank: int
    local_rank: int
    device_type: str  # "cuda" or "cpu"
    torchrun: bool  # started by torchrun (else rank 0 spawns the others)

    @property
    def device_name(self) -> str:
        """This rank's compute device, e.g. cuda:2 or cpu."""
        return f"cuda:{self.local_rank}" if self.device_type == "cuda" else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher setting RANK, WORLD_SIZE and LOCAL_RANK) started this process."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def plan_group(gpus: int | None, device: str | None) -> GroupPlan | None:
    """Check `--gpus` and `--device` (and torchrun's environment); None when one process does the prefill.

    Args:
        gpus: `--gpus N` (None: not given).
        device: `--device` (None, cpu, cuda or cuda:N).
    Raises:
        TopkError: one line, for N < 1, more GPUs than visible, no CUDA, or torchrun disagreeing with --gpus.
    """
    if gpus is not None and gpus < 1:
        raise TopkError(f"--gpus must be a positive integer, got {gpus}")
    torchrun = under_torchrun()
    if torchrun:
        try:
            world, rank, local = (int(os.environ[v]) for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError:
            raise TopkError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
        if gpus is not None and gpus != world:
            raise TopkError(
                f"--gpus {gpus} but torchrun started {world} processes (WORLD_SIZE): drop --gpus or make them agree"
            )
    else:
        if gpus is None:
            return None
        world, rank, local, local_world = gpus, 0, 0, gpus
    if device == "cpu":
        kind = "cpu"
    else:
        if device not in (None, "cuda") and not torchrun and world > 1:
            raise TopkError(
                f"--gpus {world} runs on cuda:0..cuda:{world - 1}: pass --device cuda (choose the GPUs "
                f"with CUDA_VISIBLE_DEVICES), not --device {device}"
            )
        import torch

        if not torch.cuda.is_available():
            raise TopkError(
                f"--gpus {world} runs one process per CUDA GPU, but no CUDA GPU is visible here; "
                f"--device cpu --gpus {world} runs {world} CPU processes instead"
            )
        count = torch.cuda.device_count()
        if local_world > count:
            raise TopkError(f"--gpus {local_world} but only {count} CUDA GPU{'s are' if count > 1 else ' is'} visible")
        kind = "cuda"
    if world == 1:
        return None
    import torch.distributed as dist

    if (
        not dist.is_available()
        or (kind == "cuda" and not dist.is_nccl_available())
        or (kind == "cpu" and not dist.is_gloo_available())
    ):
        raise TopkError(
            f"this torch build has no {'NCCL' if kind == 'cuda' else 'gloo'} backend for "
            f"torch.distributed: prefill with one process (drop --gpus)"
        )
    return GroupPlan(world, rank, local, kind, torchrun)


def _threads_per_rank(world: int) -> None:
    """CPU ranks share the CPUs: each takes its part, so they do not oversubscribe them."""
    import torch

    from topk_decode.cpus import usable_cpus

    torch.set_num_threads(max(1, usable_cpus() // world))


def _init_group(plan: GroupPlan, rank: int, init_method: str) -> None:
    import torch
    import torch.distributed as dist

    if plan.device_type == "cuda":
        torch.cuda.set_device(torch.device(plan.device_name if plan.torchrun else f"cuda:{rank}"))
    dist.init_process_group(
        plan.backend, init_method=init_method, rank=rank, world_size=plan.world, timeout=GROUP_TIMEOUT
    )


def _load(spec: RankSpec, device):
    """The model as build_cache loads it on this rank's device."""
    import torch

    from topk_decode.model.loading import load_model, parse_dtype

    dtype = parse_dtype(spec.dtype) or (torch.bfloat16 if device.type == "cuda" else None)
    return load_model(spec.model_dir, "cpu" if spec.offload_weights else device, dtype)


def serve_rank(ranks, spec: RankSpec) -> None:
    """A rank other than 0: load the model, wait for rank 0's token ids, compute this rank's share."""
    from topk_decode.model.gguf import is_gguf_file
    from topk_decode.prefill.distributed import receive_start, run_rank

    # a GGUF file is converted on first use: rank 0 does that before it starts the others
    model = None if is_gguf_file(spec.model_dir) else _load(spec, ranks.device)
    start = receive_start(ranks)
    if start is None:
        return
    ids, start_layer, slices = start
    if model is None:
        model = _load(spec, ranks.device)
    run_rank(model, ids, ranks, slices, spec.chunk_size, offload_weights=spec.offload_weights, start_layer=start_layer)


def parent_alive_check():
    """Raise when the process that spawned this rank is gone (killed -9, say): nothing is left to serve."""
    parent = multiprocessing.parent_process()

    def check() -> None:
        if parent is not None and not parent.is_alive():
            raise TopkError("rank 0 is gone")

    return check


def _spawned_rank(rank: int, plan: GroupPlan, init_method: str, spec: RankSpec, ready) -> None:
    """Entry of a rank spawned by rank 0 (`--gpus N`): errors are one line on stderr and an exit code."""
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from topk_decode.prefill.distributed import Ranks

        if plan.device_type == "cpu":
            _threads_per_rank(plan.world)
        device = torch.device(f"cuda:{rank}" if plan.device_type == "cuda" else "cpu")
        ready.put(rank)
        _init_group(plan, rank, init_method)
        try:
            serve_rank(Ranks(rank, plan.world, device, parent_alive_check()), spec)
        finally:
            dist.destroy_process_group()
    except KeyboardInterrupt:
        code = 130
    except TopkError as e:
        print(f"error: prefill rank {rank}: {e}", file=sys.stderr, flush=True)
        code = 2
    except BaseException as e:  # noqa: BLE001 - a rank's failure is one line; rank 0 reports the prefill failed
        if os.environ.get("TOPK_DEBUG") == "1":
            raise
        print(
            f"error: prefill rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: nothing of this process is left to clean up


class _Watch:
    """Rank 0's view of the ranks it spawned: `check` raises once one has failed."""

    def __init__(self, procs) -> None:
        self.procs = procs

    def check(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode not in (None, 0):
                raise TopkError(f"prefill rank {rank} failed (exit code {p.exitcode}); see its error above")


class LeaderPrefill:
    """Rank 0's `prefill_fn` for build_cache: joins the group (once the other ranks are up), starts them on
    the token ids, then computes its share.

    Args:
        connect: joins the process group and returns rank 0's `Ranks` (called once, at the first call or
            by `connect_now`): the spawned ranks start up while rank 0 reads, tokenizes and loads.
        spec: what the other ranks were started with.
    """

    def __init__(self, connect, spec: RankSpec) -> None:
        self.connect, self.spec, self.ranks, self.started = connect, spec, None, False

    def connect_now(self):
        """Join the group now (if not yet); returns rank 0's `Ranks`."""
        if self.ranks is None:
            self.ranks = self.connect()
        return self.ranks

    def __call__(
        self,
        model,
        ids,
        on_layer,
        chunk_size=CHUNK_SIZE,
        progress=None,
        offload_weights=False,
        device=None,
        start_layer=0,
        hidden=None,
        checkpoint=None,
        checkpoint_every=60.0,
    ):
        """`prefill_layers`' signature; `device` is this rank's (given at the group's start)."""
        from topk_decode.prefill.distributed import layer_flops, plan_slices, run_rank, send_start

        if chunk_size != self.spec.chunk_size or offload_weights != self.spec.offload_weights:
            raise ValueError("the ranks were started with another chunk size or weight offloading")
        ranks = self.connect_now()
        slices = plan_slices(len(ids), ranks.world, chunk_size, layer_flops(model.config))
        send_start(ranks, ids, start_layer, slices)
        self.started = True
        return run_rank(
            model,
            ids,
            ranks,
            slices,
            chunk_size,
            on_layer,
            progress,
            offload_weights,
            start_layer,
            hidden,
            checkpoint,
            checkpoint_every,
        )


@contextmanager
def leader(plan: GroupPlan, spec: RankSpec) -> Iterator[LeaderPrefill]:
    """Rank 0's side of the group: spawn the other ranks (unless torchrun did) and yield the `prefill_fn`
    for build_cache (which joins the group when the prefill starts); on leaving, the others have finished
    or are stopped."""
    import torch
    import torch.distributed as dist

    from topk_decode.prefill.distributed import Ranks, send_stop

    procs, store_dir, init_method = [], None, "env://"
    threads = torch.get_num_threads()
    if not plan.torchrun:
        store_dir = tempfile.mkdtemp(prefix="topk-prefill-ranks-")
        init_method = f"file://{Path(store_dir) / 'store'}"
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        procs = [
            ctx.Process(
                target=_spawned_rank,
                args=(r, plan, init_method, spec, ready),
                daemon=True,
                name=f"topk-prefill-rank-{r}",
            )
            for r in range(1, plan.world)
        ]
        for p in procs:
            p.start()
    watch = _Watch(procs)

    def connect() -> Ranks:
        for _ in procs:  # once they have imported torch, what is left of joining the group is quick
            while True:
                watch.check()
                try:
                    ready.get(timeout=0.2)
                    break
                except queue_module.Empty:
                    continue
        _init_group(plan, 0, init_method)
        return Ranks(0, plan.world, torch.device(plan.device_name), watch.check)

    prefill = LeaderPrefill(connect, spec)
    try:
        if plan.device_type == "cpu":
            _threads_per_rank(plan.world)
        if plan.torchrun:  # torchrun's ranks join at once: join them, so a failure can tell them to stop
            prefill.connect_now()
        yield prefill
        # every rank leaves the group here, right after the last collective: NCCL's destroy waits for the other
        # ranks' (a rank 0 that first waited for its spawned ranks to exit waited forever, on the 2-GPU host)
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in procs:  # they exit once they have left the group
            while p.exitcode is None:
                watch.check()
                p.join(0.05)
        watch.check()
    except BaseException:
        if plan.torchrun and prefill.ranks is not None and not prefill.started:
            try:  # torchrun's ranks wait for the token ids: tell them there are none
                send_stop(prefill.ranks, STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: torchrun stops them anyway once we exit
                pass
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)


def run_torchrun_rank(plan: GroupPlan, spec: RankSpec) -> None:
    """A torchrun rank other than 0: join the group and compute this rank's share (writes nothing)."""
    import torch
    import torch.distributed as dist

    from topk_decode.prefill.distributed import Ranks

    if plan.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        _threads_per_rank(plan.world)
    _init_group(plan, plan.rank, "env://")
    try:
        serve_rank(Ranks(plan.rank, plan.world, torch.device(plan.device_name)), spec)
    finally:
        dist.destroy_process_group()


def build_cache_ranks(
    docs,
    out,
    model_dir,
    ranks: int,
    device: str | None = None,
    chunk_size: int = CHUNK_SIZE,
    dtype: str | None = None,
    offload_weights: bool = False,
    **kwargs,
):
    """`build_cache` on `ranks` processes (sequence-parallel; one per GPU, or CPU processes with device="cpu").

    Under torchrun, call it on every rank with the same arguments: rank 0 returns (path, stats), the
    others compute their share and return None.

    Args:
        docs, out, model_dir, device, chunk_size, dtype, offload_weights, kwargs: as `build_cache`.
        ranks: processes (1: `build_cache` itself).
    """
    from topk_decode.prefill.build import build_cache

    plan = plan_group(ranks, device)
    spec = RankSpec(str(model_dir), dtype, chunk_size, offload_weights)
    if plan is not None and plan.rank != 0:
        run_torchrun_rank(plan, spec)
        return None
    with leader(plan, spec) if plan is not None else nullcontext() as prefill_fn:
        return build_cache(
            docs,
            out,
            model_dir,
            chunk_size=chunk_size,
            device=plan.device_name if plan else device,
            dtype=dtype,
            offload_weights=offload_weights,
            prefill_fn=prefill_fn,
            **kwargs,
        )


__all__ = [
    "GroupPlan",
    "RankSpec",
    "plan_group",
    "leader",
    "serve_rank",
    "run_torchrun_rank",
    "build_cache_ranks",
    "under_torchrun",
    "LeaderPrefill",
    "parent_alive_check",
]
