"""Step-channel latency of a local TP/DCP engine (CPU, no GPU needed): how long after rank 0 posts a
step the worker holds it, for the general path (rendezvous-store key + gloo broadcasts) and the
same-host shared-memory link (``distributed/shm_channel.py``).

    python3 benchmarks/step_channel.py --out DIR [--iters 300]

Two local ranks (gloo). Messages are posted ``plain`` (no tensors: pickled as is on the link; the
general path always uses ``torch.save``). Per message kind (a uniform decode step of batch 1 with a 2048-block table, of
batch 64 with 512 blocks: ``runner.UniformStep``) and transport: rank 0 posts, the worker receives and
answers with a one-element gloo all-reduce; the median of ``--iters`` round trips minus the median
all-reduce alone (measured in the same run) is the post -> received latency. Also the ``torch.save``
packing time and the message size. This latency is on the critical path of every TP/DCP decode step
(the workers' first collective waits for it). Writes DIR/step_channel.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from longflash.distributed import comm  # noqa: E402
from longflash.distributed.launch import _context, run_ranks  # noqa: E402
from longflash.distributed.runner import UniformStep  # noqa: E402
from longflash.distributed.shm_channel import LocalLink  # noqa: E402
from longflash.runner.cuda_graph import UniformBatch  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

KINDS = {"decode b1, 2048 blocks": (1, 2048), "decode b64, 512 blocks": (64, 512)}


def message(B: int, n: int) -> UniformStep:
    return UniformStep(UniformBatch(1, np.arange(B, dtype=np.int64), np.full(B, 8000, np.int64),
                                    np.arange(B * n, dtype=np.int32).reshape(B, n)), True, B)


def _rank(rank: int, world: int, port: int, link: LocalLink, iters: int, out: str) -> None:
    comm.init_distributed(rank, world, port, timeout_s=60)
    ps = comm.initialize_model_parallel(world, 1)
    g, one = ps.tp, torch.zeros(1)
    res = {}
    for transport in ("general", "shared memory"):
        lk = None if transport == "general" else (link if rank == 0 else link.for_worker(rank))
        ch = comm.StepChannel(g, prefix=f"bench/{transport}", link=lk)
        for kind, (B, n) in KINDS.items():
            msg = message(B, n) if rank == 0 else None
            times, base = [], []
            for i in range(iters + 10):
                t = time.perf_counter()
                if rank == 0:
                    ch.post(msg, plain=True)
                else:
                    ch.recv()
                g.all_reduce(one)
                times.append(time.perf_counter() - t)
                t = time.perf_counter()
                g.all_reduce(one)
                base.append(time.perf_counter() - t)
            if rank == 0:
                t = time.perf_counter()
                for _ in range(100):
                    size = comm._pack(msg).numel()
                res[f"{transport} | {kind}"] = {
                    "latency_ms": 1e3 * (statistics.median(times[10:]) - statistics.median(base[10:])),
                    "round_trip_ms": 1e3 * statistics.median(times[10:]),
                    "all_reduce_ms": 1e3 * statistics.median(base[10:]),
                    "pack_ms": 1e3 * (time.perf_counter() - t) / 100, "bytes": size}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    comm.destroy_distributed()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    raw = os.path.join(args.out, "step_channel.raw.json")
    link = LocalLink.create(_context(), 1)
    codes = run_ranks(_rank, 2, (link, args.iters, raw), timeout_s=600)
    if codes != [0, 0]:
        print(f"ranks exited {codes}")
        return 1
    rows = json.load(open(raw))
    os.remove(raw)
    commit = provenance.commit(short=True)
    res = {"commit": commit, "command": "python3 benchmarks/step_channel.py " + " ".join(sys.argv[1:]),
           "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "rows": rows}
    with open(os.path.join(args.out, "step_channel.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = ["# Step-channel latency, rank 0 -> a local worker (2 ranks, gloo, CPU)", "",
          f"commit `{commit}`, `{res['command']}`; {os.cpu_count()} cores, 1-min load {res['load_avg_1min']:.1f}", "",
          "| transport | message | post -> received ms | round trip ms | all-reduce alone ms | torch.save ms | bytes |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {k.split(' | ')[0]} | {k.split(' | ')[1]} | {r['latency_ms']:.3f} | {r['round_trip_ms']:.3f} | "
           f"{r['all_reduce_ms']:.3f} | {r['pack_ms']:.3f} | {r['bytes']:,} |" for k, r in rows.items()]
    with open(os.path.join(args.out, "step_channel.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
