"""Start the TP/DCP process model from an LLMEngine (rank 0) and run the worker ranks.

Rank 0 has already built its weight shards (``comm.planned_tp_group``); each worker builds its own
after joining the group (``load_model`` reads only the rank's slices).

Devices: on the CPU every rank uses gloo; on GPUs rank r uses ``cuda:<local rank>`` and NCCL
(``placement.bind_rank_device``; rank 0's GPU is bound by ``LLMEngine`` before it loads its shards).

Single host: rank 0 (the process that builds the engine) starts ranks 1..N-1 itself (forkserver),
on ``--master-port`` or a free port; rank r takes ``cuda:r``. Multi-host: launch every rank with torchrun, e.g.
``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --master-addr HOST0 --master-port 29500 -m
longflash.entrypoints.cli generate -tp 4 -dcp 4 ...``; the engine reads ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK`` for the GPU) and, on every rank but 0, turns
into a worker that exits when rank 0 shuts down (see ``docs/dcp.md``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import multiprocessing
import signal
import sys
import time
import weakref

import torch

from longflash.distributed import comm
from longflash.distributed.launch import _context
from longflash.distributed.placement import bind_rank_device
from longflash.distributed.runner import DCPModelRunner
from longflash.distributed.shm_channel import LocalLink

logger = logging.getLogger("longflash")


def _make_runner(model, config, num_blocks: int, kv_cache_dtype: torch.dtype, device: torch.device,
                 ps: comm.ParallelState, proposer=None, link=None) -> DCPModelRunner:
    return DCPModelRunner(model, num_blocks, config.block_size, kv_cache_dtype, device,
                          config.calculate_kv_scales, config.context_workspace_rows,
                          parallel=ps, channel=comm.StepChannel(ps.tp, link=link), proposer=proposer)


def _worker_proposer(drafter: str | None, model, config, num_blocks: int, dtype: torch.dtype, device: torch.device):
    """This worker's DFlash proposer with its replicated draft pool (``num_blocks`` logical blocks of
    ``block_size * dcp`` tokens), or None without a drafter."""
    if drafter is None:
        return None
    from longflash.spec_decode.proposer import DFlashProposer
    proposer = DFlashProposer.from_engine_config(drafter, model, dtype, device, config)
    proposer.allocate(num_blocks, config.block_size * config.decode_context_parallel_size)
    return proposer


def _worker_main(rank: int, world: int, port: int, config, num_blocks: int, kv_cache_dtype: torch.dtype,
                 dtype: torch.dtype, num_threads: int, drafter: str | None = None, link=None) -> None:
    """Rank 1..N-1 (local processes): on ``cuda:<rank>`` (made current before anything touches the GPU)
    or the CPU, load the model (and the DFlash drafter at ``drafter``), build this rank's KV shard and
    replicated draft pool, run steps until rank 0 stops. ``num_threads`` (rank 0's torch thread count)
    applies on the CPU only, where the ranks share the cores."""
    from longflash.models.loader import load_model
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints where a worker is
    # Ctrl-C in a terminal reaches the whole process group: rank 0 alone handles it (a server ends its
    # requests with 503s and then stops the workers; a script's exit hook stops them), so a worker must
    # not die of it in the middle of a step (its peers would see "connection closed" instead).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = bind_rank_device(config.device, world, rank)
        if device.type == "cpu":
            torch.set_num_threads(num_threads)
        comm.init_distributed(rank, world, port, timeout_s=config.distributed_timeout_s, device=device)
        ps = comm.initialize_model_parallel(world, config.decode_context_parallel_size,
                                            config.cp_kv_cache_interleave_size)
        torch.manual_seed(config.seed)
        model, _ = load_model(config.model, dtype, device, progress=False)
        proposer = _worker_proposer(drafter, model, config, num_blocks, dtype, device)
        runner = _make_runner(model, config, num_blocks, kv_cache_dtype, device, ps, proposer, link)
        comm.mark_ready(rank)
        runner.serve_forever()
        runner.release_graphs()
    except BaseException:
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():  # rank 0 was killed: the error is only its echo
            logger.error("TP/DCP worker rank %d: rank 0 (pid %s) exited; stopping", rank, parent.pid)
        else:
            logger.exception("TP/DCP worker rank %d failed", rank)
        sys.exit(1)
    comm.destroy_distributed()


def _check_started(procs) -> None:
    """Rank 0 waiting for its local workers to join: raise RuntimeError naming the first that exited."""
    for r, p in enumerate(procs, start=1):
        if p.exitcode is not None:
            raise RuntimeError(
                f"TP/DCP worker rank {r} exited during start-up (code {p.exitcode}). Workers are started with "
                f"forkserver/spawn and re-import the main module: a script must create the engine under "
                f"`if __name__ == \"__main__\":` (the worker's own error is printed above)")


class _Rank0Runner(DCPModelRunner):
    """Rank 0's runner: checks that the locally started workers are alive before each step and
    stops them on shutdown."""

    procs: list = []

    def check_workers(self) -> None:
        """Raises RuntimeError naming the first locally started worker rank that has exited.
        (torchrun-started workers are not children of rank 0: their death surfaces as a failed
        or timed-out collective in the next step.)"""
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise RuntimeError(f"TP/DCP worker rank {r} exited (code {p.exitcode}); the engine cannot continue")

    def prepare(self, sched):
        self.check_workers()
        return super().prepare(sched)

    # True from the start of a step until it returns: a step left open (Ctrl-C in its middle: a
    # KeyboardInterrupt is not an Exception) leaves the workers inside collectives rank 0 will not join.
    _step_open = False

    @contextlib.contextmanager
    def _step(self):
        """Around a step's collectives: a failure names a dead worker; an interruption (not an
        Exception) leaves ``_step_open`` set for :meth:`shutdown`."""
        self._step_open = True
        try:
            yield
        except Exception as e:
            self._name_dead_worker(e)
            raise
        self._step_open = False

    def execute(self, sched, all_logits: bool = False, tapper=None, proposer=None):
        with self._step():
            return super().execute(sched, all_logits, tapper, proposer)

    def propose(self, proposer, requests, masks=None):
        with self._step():
            return super().propose(proposer, requests, masks)

    def _name_dead_worker(self, error: Exception, wait_s: float = 2.0) -> None:
        """A step failed (typically a collective: "Connection closed by peer"): if a local worker
        exited (it may take a moment to be reaped), raise RuntimeError naming it, chained to ``error``;
        otherwise return and let the caller re-raise ``error``. Only a communication error (a
        ``torch.distributed`` error, or gloo's / NCCL's RuntimeError) waits for a worker to be reaped."""
        msg = str(error).lower()
        if not (isinstance(error, torch.distributed.DistError) or "gloo" in msg or "nccl" in msg):
            wait_s = 0.0
        deadline = time.monotonic() + wait_s
        while self.procs:
            try:
                self.check_workers()
            except RuntimeError as dead:
                raise dead from error
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.draft_checks:
            logger.info("DCP DFlash: %d draft steps checked on every rank, %d worker drafts differed from rank 0's",
                        self.draft_checks, self.draft_mismatches)
        interrupted = self._step_open and bool(self.procs)
        try:
            if interrupted:
                # The workers wait in a collective of the interrupted step (until its timeout): stop
                # them now rather than after a stop message they cannot read.
                for p in self.procs:
                    p.kill()
            elif all(p.exitcode is None for p in self.procs):
                self.channel.post(None, deadline_s=5.0)   # bounded: a stuck worker is killed below
        except Exception as e:  # noqa: BLE001 — a dead worker makes the stop message fail; kill below
            logger.warning("DCP shutdown: could not reach every worker (%s); stopping them", e)
        finally:
            for p in self.procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            if not interrupted:
                self.release_graphs()
                comm.destroy_distributed()
            elif self.device.type == "cpu":  # gloo: the group can go (a new engine may follow in this process)
                comm.destroy_distributed()
            # NOTE: on GPUs an interrupted step's NCCL kernels wait for the killed peers; synchronizing or
            # destroying the communicators could block, so graphs and NCCL state are left to the process exit.


def _stop_at_exit(runner: _Rank0Runner) -> None:
    """Stop the workers when the interpreter exits with the engine still open (a script that never
    calls ``shutdown``): they get the stop message and exit cleanly. Without it, multiprocessing's own
    exit hook (registered earlier, so it runs later) SIGTERMs the daemon workers, which then leave
    their semaphores behind ("resource_tracker: ... leaked semaphore objects"). Holds only a weak
    reference: an engine dropped earlier is not kept alive."""
    ref = weakref.ref(runner)

    def stop() -> None:
        r = ref()
        if r is not None:
            r.shutdown()
    atexit.register(stop)


def start_dcp(engine) -> DCPModelRunner:
    """Join or start the process group and return rank 0's runner (never returns on a torchrun
    worker rank: it serves steps, then exits the process).

    Raises RuntimeError when the workers cannot be started or the rendezvous times out.
    """
    cfg = engine.config
    world = cfg.tensor_parallel_size
    if cfg.decode_context_parallel_size > 1 and engine.model.kv_cache_spec().num_planes != 1:
        raise NotImplementedError("decode-context parallelism needs an MLA model (latent cache); this model has "
                                  "a K/V cache (GQA): run it with decode_context_parallel_size 1")
    env = comm.DistEnv.from_torchrun_env()
    procs, link = [], None
    if env is not None:
        if env.world_size != world:
            raise ValueError(f"torchrun WORLD_SIZE {env.world_size} != tensor_parallel_size {world}")
        comm.init_distributed(timeout_s=cfg.distributed_timeout_s, device=engine.device)
        if env.rank != 0:
            ps = comm.initialize_model_parallel(world, cfg.decode_context_parallel_size,
                                                cfg.cp_kv_cache_interleave_size)
            runner = _make_runner(engine.model, cfg, engine.num_blocks, engine.kv_cache_dtype, engine.device, ps,
                                  engine.proposer)
            runner.serve_forever()
            runner.release_graphs()
            comm.destroy_distributed()
            sys.exit(0)
    else:
        port = cfg.master_port or comm.free_port()
        ctx = _context()
        link = LocalLink.create(ctx, world - 1)  # same host: steps travel through shared memory
        for r in range(1, world):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, world, port, cfg, engine.num_blocks, engine.kv_cache_dtype, engine.dtype,
                                  torch.get_num_threads(), engine.proposer.path if engine.proposer else None,
                                  link.for_worker(r)))
            p.start()
            procs.append(p)
        try:
            comm.init_distributed(0, world, port, timeout_s=cfg.distributed_timeout_s, device=engine.device,
                                  check_peers=lambda: _check_started(procs))
        except BaseException:
            for p in procs:
                p.kill()
            raise
    ps = comm.initialize_model_parallel(world, cfg.decode_context_parallel_size, cfg.cp_kv_cache_interleave_size)
    runner = _Rank0Runner(engine.model, engine.num_blocks, cfg.block_size, engine.kv_cache_dtype,
                          engine.device, cfg.calculate_kv_scales, cfg.context_workspace_rows,
                          parallel=ps, channel=comm.StepChannel(ps.tp, link=link), proposer=engine.proposer)
    runner.procs = procs
    runner.channel.check_worker = lambda rank: runner.check_workers()
    _stop_at_exit(runner)
    if procs:
        comm.wait_until_ready(world, runner.check_workers, cfg.distributed_timeout_s)
    logger.info("tensor parallelism %d, decode-context parallelism %d: %d ranks (%s, %s, rank 0 on %s), "
                "interleave %d", world, cfg.decode_context_parallel_size, world,
                "torchrun" if env is not None else "local processes", comm.backend(), engine.device,
                cfg.cp_kv_cache_interleave_size)
    return runner
