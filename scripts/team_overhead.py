"""What a parallel region of numba's thread team costs by itself: the floor under every round of a split call.

    python scripts/team_overhead.py --threads 15 --rounds 1 5 --gap-us 0 500

Times a compiled call of `rounds` back-to-back `prange` rounds that do no work (each iteration stores the
cycle counter), called again and again with a gap between calls in which the calling thread spins, as it
does while it waits for the GPU's part of a layer (0 µs: back to back; 500 µs: about one Llama-3-8B layer's
GPU time at 128K, docs/BENCHMARKS.md run 15). Prints one JSON line per (rounds, gap): numba's threading
layer, microseconds per call and per round (median over the calls).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numba  # noqa: E402

from topk_decode.index.compiled import cycles, pjit, prange, set_threads  # noqa: E402


@pjit
def _rounds(stamps, rounds):
    """`rounds` parallel regions of one trivial iteration per team member."""
    for r in range(rounds):
        for t in prange(stamps.shape[1]):
            stamps[r, t] = cycles()


def _spin(seconds: float) -> None:
    """Busy-wait on this thread (as a thread waiting for the GPU with a spin-wait does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(threads: int, rounds: int, gap_us: float, calls: int) -> dict:
    """Median µs of one call of `rounds` empty rounds on `threads` threads, `gap_us` of spinning between calls."""
    set_threads(threads)
    stamps = np.zeros((rounds, threads), np.int64)
    _rounds(stamps, rounds)                      # compile, start the team
    times = []
    for _ in range(calls):
        _spin(gap_us * 1e-6)
        t = time.perf_counter()
        _rounds(stamps, rounds)
        times.append(time.perf_counter() - t)
    us = float(np.median(times)) * 1e6
    return {"threading_layer": numba.threading_layer(), "threads": threads, "rounds": rounds, "gap_us": gap_us,
            "us_per_call": round(us, 1), "us_per_round": round(us / rounds, 1),
            "p90_us_per_call": round(float(np.percentile(times, 90)) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[15])
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--gap-us", type=float, nargs="+", default=[0, 500])
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    for threads in a.threads:
        for rounds in a.rounds:
            for gap in a.gap_us:
                print(json.dumps(measure(threads, rounds, gap, a.calls)), flush=True)


if __name__ == "__main__":
    main()
