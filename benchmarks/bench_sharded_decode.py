"""Simulate one decode step of a KV cache sharded across hosts: processes on loopback, gloo, real messages.

    python benchmarks/bench_sharded_decode.py --shape llama-3-8b --shards 2 --steps 200 --out sim.json

Rank 0 is the driver (the GPU host running the dense part of each layer); ranks 1..S hold the KV
shards. Per decode step, for each layout of docs/SCALE.md:
  head      every shard holds all layers for Hkv/S KV heads: per layer the driver sends each shard its
            query heads and gets back their top-k attention partials (output + log-sum-exp), to merge;
  layer     shard s holds the KV of a contiguous block of layers (weights stay on the driver): per layer
            one round trip to the one shard that owns it, the same bytes as `head`;
  pipeline  shard s holds its layers' KV *and weights*: the hidden state goes driver → shard 1 → ... →
            shard S → driver (the next token id), S + 1 one-way messages per token.
Messages carry the real sizes (bf16 payloads sent as int16, log-sum-exp fp32); the shards do no
search: this measures the messaging alone, the part sharding adds. Two transports: `gloo`
(torch.distributed point-to-point, as a torch.distributed deployment would send them) and `tcp` (plain
sockets with TCP_NODELAY and fixed-size messages, what a purpose-built shard server would use). Prints
and writes the bytes per layer and per token and the measured step latencies (median, p90).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import selectors
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from topk_decode.bench.shapes import make_config
from topk_decode.model.blocks import ModelShape


def message_bytes(shape: ModelShape, shards: int) -> dict:
    """Bytes on the driver's link per decode token, by layout (bf16 activations, fp32 log-sum-exp)."""
    q = shape.n_heads * shape.head_dim * 2  # a layer's query heads
    reply = shape.n_heads * (shape.head_dim * 2 + 4)  # their attention outputs + log-sum-exps
    hidden = shape.hidden_size * 2
    return {
        "query_per_layer": q,
        "reply_per_layer": reply,
        "hidden": hidden,
        "head_per_token": shape.n_layers * (q + reply),
        "layer_per_token": shape.n_layers * (q + reply),
        "pipeline_per_token": (shards + 1) * hidden,
        "round_trips_head": shape.n_layers,
        "round_trips_layer": shape.n_layers,
        "hops_pipeline": shards + 1,
    }


LINKS = {"10 Gbit/s": 10e9 / 8, "25 Gbit/s": 25e9 / 8, "NVLink node": 330e9}  # bytes/s (NVLink: bus bandwidth
# of an all-reduce on the H100 hosts, 329-361 GB/s, device notes 2026-11-13)


def implied(bytes_: dict, rtt_us: float, wire_rtt_us: float, nvlink_rtt_us: float) -> dict:
    """Network time per decode token (ms) and the tok/s ceiling it implies, per layout and link.

    Round trips cost the measured software round trip `rtt_us` plus an assumed wire round trip
    (`wire_rtt_us` on Ethernet; on NVLink `nvlink_rtt_us` replaces both); bytes cross the GPU host's link.
    """
    out = {}
    for link, bw in LINKS.items():
        rtt = (nvlink_rtt_us if link == "NVLink node" else rtt_us + wire_rtt_us) * 1e-6
        for layout, trips, nbytes in (
            ("head", bytes_["round_trips_head"], bytes_["head_per_token"]),
            ("pipeline", bytes_["hops_pipeline"] / 2, bytes_["pipeline_per_token"]),
        ):
            t = trips * rtt + nbytes / bw  # a one-way hop costs half a round trip
            out[f"{layout} @ {link}"] = {"ms_per_token": round(1e3 * t, 3), "tok_s_ceiling": round(1 / t)}
    return out


def _payload(nbytes: int) -> torch.Tensor:
    return torch.zeros((nbytes + 1) // 2, dtype=torch.int16)


def _rank(rank: int, world: int, store: str, shape: ModelShape, steps: int, warmup: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    S, L, H = world - 1, shape.n_layers, shape.n_heads
    per = H // S  # query heads per shard (head layout)
    q_part, r_part = _payload(per * shape.head_dim * 2), _payload(per * (shape.head_dim * 2 + 4))
    q_all, r_all = _payload(H * shape.head_dim * 2), _payload(H * (shape.head_dim * 2 + 4))
    hidden, token = _payload(shape.hidden_size * 2), torch.zeros(1, dtype=torch.int64)
    owner = [1 + layer * S // L for layer in range(L)]
    times: dict[str, list[float]] = {"head": [], "layer": [], "pipeline": []}
    for layout in times:
        for step in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            if layout == "head":
                for _ in range(L):
                    if rank == 0:
                        for w in [dist.isend(q_part, s) for s in range(1, world)]:
                            w.wait()
                        for w in [dist.irecv(r_part.clone(), s) for s in range(1, world)]:
                            w.wait()
                    else:
                        dist.recv(q_part, 0)
                        dist.send(r_part, 0)
            elif layout == "layer":
                for layer in range(L):
                    if rank == 0:
                        dist.send(q_all, owner[layer])
                        dist.recv(r_all, owner[layer])
                    elif rank == owner[layer]:
                        dist.recv(q_all, 0)
                        dist.send(r_all, 0)
            else:
                if rank == 0:
                    dist.send(hidden, 1)
                    dist.recv(token, S)
                else:
                    dist.recv(hidden, rank - 1)
                    if rank < S:
                        dist.send(hidden, rank + 1)
                    else:
                        dist.send(token, 0)
            if rank == 0 and step >= warmup:
                times[layout].append(time.perf_counter() - t0)
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def _recv_exact(conn: socket.socket, buf: bytearray) -> bool:
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def _connect(port: int) -> socket.socket:
    for _ in range(6000):  # the shards may take a while to start on a busy machine (they import torch)
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise RuntimeError(f"no shard listens on {port}")


def _tcp_shard(s: int, shards: int, port0: int, sizes: dict) -> None:
    """Shard s of the tcp transport: answer the driver's queries, forward the pipeline's hidden state."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port0 + s))
    server.listen(2)
    nxt = _connect(port0 + s + 1) if s < shards else None
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    driver = None
    kind = bytearray(1)
    while True:
        for key, _ in sel.select():
            conn = key.fileobj
            if conn is server:
                c, _ = server.accept()
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.register(c, selectors.EVENT_READ)
                continue
            if not _recv_exact(conn, kind):
                return
            k = bytes(kind)
            if k == b"d":  # the driver introduces itself
                driver = conn
            elif k in (b"h", b"l"):
                _recv_exact(conn, bytearray(sizes["q_" + k.decode()]))
                conn.sendall(k + bytes(sizes["r_" + k.decode()]))
            elif k == b"p":
                buf = bytearray(sizes["hidden"])
                _recv_exact(conn, buf)
                if nxt is not None:
                    nxt.sendall(b"p" + buf)
                else:
                    driver.sendall(b"t" + bytes(8))
            elif k == b"x":
                if nxt is not None:
                    nxt.sendall(b"x")
                return


def _tcp_driver(shape: ModelShape, shards: int, port0: int, sizes: dict, steps: int, warmup: int) -> dict:
    conns = {s: _connect(port0 + s) for s in range(1, shards + 1)}
    for c in conns.values():
        c.sendall(b"d")
    L = shape.n_layers
    owner = [1 + layer * shards // L for layer in range(L)]
    times: dict[str, list[float]] = {"head": [], "layer": [], "pipeline": []}
    q_h, q_l, hidden = bytes(sizes["q_h"]), bytes(sizes["q_l"]), bytes(sizes["hidden"])
    r_h, r_l, tok = bytearray(1 + sizes["r_h"]), bytearray(1 + sizes["r_l"]), bytearray(9)
    for layout in times:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            if layout == "head":
                for _ in range(L):
                    for c in conns.values():
                        c.sendall(b"h" + q_h)
                    for c in conns.values():
                        _recv_exact(c, r_h)
            elif layout == "layer":
                for layer in range(L):
                    conns[owner[layer]].sendall(b"l" + q_l)
                    _recv_exact(conns[owner[layer]], r_l)
            else:
                conns[1].sendall(b"p" + hidden)
                _recv_exact(conns[shards], tok)
            if step >= warmup:
                times[layout].append(time.perf_counter() - t0)
    conns[1].sendall(b"x")
    for c in conns.values():
        c.close()
    return times


def _run_tcp(shape: ModelShape, shards: int, steps: int, warmup: int, port0: int) -> dict:
    per = shape.n_heads // shards
    sizes = {
        "q_h": per * shape.head_dim * 2,
        "r_h": per * (shape.head_dim * 2 + 4),
        "q_l": shape.n_heads * shape.head_dim * 2,
        "r_l": shape.n_heads * (shape.head_dim * 2 + 4),
        "hidden": shape.hidden_size * 2,
    }
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_tcp_shard, args=(s, shards, port0, sizes)) for s in range(shards, 0, -1)]
    for proc in procs:
        proc.start()
    try:
        return _tcp_driver(shape, shards, port0, sizes, steps, warmup)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()


def _run_gloo(shape: ModelShape, shards: int, steps: int, warmup: int) -> dict:
    world = shards + 1
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_rank, args=(r, world, f"{d}/store", shape, steps, warmup, results))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        times = results.get()
        for proc in procs:
            proc.join()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--transports", default="tcp,gloo", help="comma-separated: tcp, gloo")
    p.add_argument("--port", type=int, default=29631, help="tcp: shard s listens on PORT + s (loopback)")
    p.add_argument(
        "--wire-rtt-us",
        type=float,
        default=20.0,
        help="assumed wire round trip of a switched "
        "10/25 GbE network, added to the measured loopback one (not measured here)",
    )
    p.add_argument(
        "--nvlink-rtt-us",
        type=float,
        default=10.0,
        help="assumed round trip between GPUs of one NVLink node (not measured here)",
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    shape = ModelShape.from_config(make_config(args.shape))
    summary = {
        "shape": args.shape,
        "shards": args.shards,
        "steps": args.steps,
        "bytes": message_bytes(shape, args.shards),
        "layers": shape.n_layers,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": multiprocessing.cpu_count(),
    }
    for transport in args.transports.split(","):
        times = (
            _run_tcp(shape, args.shards, args.steps, args.warmup, args.port)
            if transport == "tcp"
            else _run_gloo(shape, args.shards, args.steps, args.warmup)
        )
        for layout, ts in times.items():
            ts = sorted(ts)
            row = {
                "step_ms_median": round(1e3 * statistics.median(ts), 3),
                "step_ms_p90": round(1e3 * ts[int(0.9 * (len(ts) - 1))], 3),
            }
            if layout != "pipeline":
                row["round_trip_us_median"] = round(1e6 * statistics.median(ts) / shape.n_layers, 1)
            summary[f"{transport}_{layout}"] = row
    if "tcp_layer" in summary:  # one driver-shard round trip over plain TCP: the software floor
        summary["implied"] = implied(
            summary["bytes"], summary["tcp_layer"]["round_trip_us_median"], args.wire_rtt_us, args.nvlink_rtt_us
        )
        summary["assumed"] = {"wire_rtt_us": args.wire_rtt_us, "nvlink_rtt_us": args.nvlink_rtt_us}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
