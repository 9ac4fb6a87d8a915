"""Diagnose the decoder's compiled-search threads: how many numba threads a parallel region gets inside
a decode step vs outside, the CPU affinity, and step times with/without torch.compile. Prints JSON lines."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numba
from numba import njit, prange

from topk_decode.bench.shapes import build_model
from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder
from topk_decode.index import compiled


@njit(parallel=True)
def _ids(out):
    for i in prange(out.shape[0]):
        out[i] = numba.get_thread_id()


def threads_seen() -> int:
    out = np.zeros(64, np.int64)
    _ids(out)
    return len(set(out.tolist()))


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    dev = torch.device("cuda", 0)
    say(where="start", affinity=len(os.sched_getaffinity(0)), numba_threads=numba.get_num_threads(), seen=threads_seen(),
        layer=numba.threading_layer())
    model = build_model("llama-3-8b", dev, torch.bfloat16)
    ckv = synthetic_kv(32, 8, 128, n, torch.bfloat16, 0)
    dec = TopKDecoder(model, ckv, DecodeConfig(k=1024, strategy="routed"), graphs=True)
    strat = dec.strategy
    conv = dec.new_conversation()
    logits = dec.forward([5], conv)
    for threads in (16, 8, 1):
        strat.threads = threads
        k0 = strat.stats.extra["kernel_s"]
        t = time.perf_counter()
        for _ in range(6):
            logits = dec.forward([int(torch.argmax(logits))], conv)
        say(where="steps", threads=threads, ms_per_step=round(1e3 * (time.perf_counter() - t) / 6, 1),
            kernel_ms=round(1e3 * (strat.stats.extra["kernel_s"] - k0) / 6, 1))
    strat.threads = 16
    seg, routes = dec.segments, dec.segments.routes
    with torch.inference_mode():
        for copies in (False, True):
            for rep in range(3):
                t = time.perf_counter()
                for layer in range(32):
                    q, o, mz = seg.q_host[layer], seg.part_o[layer], seg.part_mz[layer]
                    order, take = routes.host_route(layer)
                    if copies:
                        q, o, mz, order, take = q.clone(), o.clone(), mz.clone(), order.clone(), take.clone()
                    strat.select_and_attend(layer, q, 1024, None, o, mz, route=(order, take))
                say(where="outside step, 32 layers", copies=copies, ms=round(1e3 * (time.perf_counter() - t), 1))
    lay = [t for t in routes.take_host if t is not None]
    say(take=[int(x) for x in routes.take_host[0]], width=routes.tables[0].width, budget=routes.tables[0].budget,
        sizes_taken=[int(strat._sizes[0][h][routes.order_host[0][h][:int(routes.take_host[0][h])].long()].sum())
                     for h in range(8)])


if __name__ == "__main__":
    main()
