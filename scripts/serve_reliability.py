"""Re-runs issue 32's failure table against a live `topk serve` (a subprocess): one line per row.

    python scripts/serve_reliability.py CACHE [--src DIR] [--rows body,disconnect,sigint,malformed]
        [--body-mb 50] [--parallel 3] [--prompt-tokens 8192]

Rows (each on a fresh server):
  body        --parallel bodies of --body-mb MB at once, and a normal question sent 1 s later: each big
              one's status and seconds, the normal one's seconds, the server's peak RSS (VmHWM).
  disconnect  a --prompt-tokens message whose client leaves after 3 s, then the normal question: its seconds.
  sigint      a streamed --prompt-tokens message; SIGINT to the server 3 s in: seconds to exit, and whether
              the stream got an error event and `data: [DONE]`.
  malformed   lone surrogate, 100,000-deep nesting, huge numbers, wrong types: each status, and whether the
              server's log holds a traceback.
--src: the checkout whose topk_decode runs the server (default: this one), e.g. `git archive main` unpacked
somewhere for before/after figures. The normal question is the demo cache's amber-fox one (16 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

QUESTION = "What is the special magic number for amber-fox?"


def read_all(sock) -> bytes:
    """Everything the server sends until it closes the connection (or the socket fails)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except OSError:
        pass
    return data


def start_server(src: Path, cache: Path) -> tuple[subprocess.Popen, str, int]:
    """`topk serve CACHE --port 0` from `src`: (process, host, port) once /health answers."""
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "topk_decode", "serve", str(cache), "--port", "0", "--device", "cpu"],
        cwd=src,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    host, port = line.split(" on http://")[1].split("/v1")[0].split(":")
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5).read()
            return proc, host, int(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> str:
    """Stop the server (SIGINT, then kill after 60 s); its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stderr.read()


def peak_rss_gb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), GB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def post(host: str, port: int, path: str, body: bytes, timeout: float = 900) -> tuple[int, bytes]:
    """POST `body`, stopping the upload as soon as the server answers (as curl does): (status, response body)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        sock.sendall(head)
        view = memoryview(body)
        for i in range(0, len(body), 1 << 16):
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered before reading it all (a 413)
            sock.sendall(view[i : i + (1 << 16)])
    except OSError:
        pass
    data = read_all(sock)
    sock.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    return status, rest


def chat_body(content: str, **extra) -> bytes:
    return json.dumps({"model": "demo-cache", "messages": [{"role": "user", "content": content}], **extra}).encode()


def timed_question(host: str, port: int) -> tuple[int, float]:
    t = time.monotonic()
    status, _ = post(host, port, "/v1/chat/completions", chat_body(QUESTION, max_tokens=16))
    return status, time.monotonic() - t


def row_body(src: Path, cache: Path, body_mb: float, parallel: int) -> dict:
    proc, host, port = start_server(src, cache)
    words = "amber fox harbour ledger " * int(body_mb * 2**20 / 25 + 1)
    body = chat_body(words[: int(body_mb * 2**20)])
    results: list = [None] * parallel

    def big(i: int) -> None:
        t = time.monotonic()
        status, _ = post(host, port, "/v1/chat/completions", body)
        results[i] = (status, round(time.monotonic() - t, 1))

    threads = [threading.Thread(target=big, args=(i,)) for i in range(parallel)]
    for t in threads:
        t.start()
    time.sleep(1)
    status, normal_s = timed_question(host, port)
    for t in threads:
        t.join()
    rss = peak_rss_gb(proc.pid)
    log = stop_server(proc)
    return {
        "row": "body",
        "body_mb": body_mb,
        "parallel": parallel,
        "big": results,
        "normal_status": status,
        "normal_s": round(normal_s, 1),
        "peak_rss_gb": round(rss, 2),
        "traceback": "Traceback" in log,
    }


def row_disconnect(src: Path, cache: Path, prompt_tokens: int) -> dict:
    proc, host, port = start_server(src, cache)
    body = chat_body(" the" * prompt_tokens, max_tokens=16)
    sock = socket.create_connection((host, port))
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    time.sleep(3)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    status, normal_s = timed_question(host, port)
    log = stop_server(proc)
    return {
        "row": "disconnect",
        "prompt_tokens": prompt_tokens,
        "normal_status": status,
        "normal_s": round(normal_s, 1),
        "traceback": "Traceback" in log,
    }


def row_sigint(src: Path, cache: Path, prompt_tokens: int) -> dict:
    proc, host, port = start_server(src, cache)
    body = chat_body(" the" * prompt_tokens, max_tokens=16, stream=True)
    sock = socket.create_connection((host, port), timeout=900)
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    time.sleep(3)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    data = read_all(sock)
    stream_s = time.monotonic() - t
    try:
        proc.wait(900)
    except subprocess.TimeoutExpired:
        proc.kill()
    exit_s = time.monotonic() - t
    log = proc.stderr.read()
    return {
        "row": "sigint",
        "prompt_tokens": prompt_tokens,
        "exit_s": round(exit_s, 1),
        "stream_end_s": round(stream_s, 1),
        "error_event": b'"error"' in data,
        "done": b"data: [DONE]" in data,
        "traceback": "Traceback" in log,
    }


MALFORMED = {
    "lone surrogate": b'{"model": "demo-cache", "messages": [{"role": "user", "content": "\\ud800"}]}',
    "nested 100,000 deep": b'{"model": "demo-cache", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "max_tokens 1e400": chat_body("hi")[:-1] + b', "max_tokens": 1e400}',
    "max_tokens 10**100": chat_body("hi", max_tokens=10**100),
    "temperature -1e400": chat_body("hi")[:-1] + b', "temperature": -1e400}',
    "seed of 5000 digits": chat_body("hi")[:-1] + b', "seed": ' + b"9" * 5000 + b"}",
    "seed 10**100": chat_body("hi", seed=10**100, max_tokens=2),
    "role 5": b'{"model": "demo-cache", "messages": [{"role": 5, "content": "hi"}]}',
    "stop [1]": chat_body("hi", stop=[1]),
    "stop lone surrogate": chat_body("hi")[:-1] + b', "stop": ["\\udfff"]}',
    "messages an object": b'{"model": "demo-cache", "messages": {"role": "user"}}',
    "invalid UTF-8": b'{"model": "demo-cache", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
}


def row_malformed(src: Path, cache: Path) -> dict:
    proc, host, port = start_server(src, cache)
    statuses = {name: post(host, port, "/v1/chat/completions", body)[0] for name, body in MALFORMED.items()}
    log = stop_server(proc)
    return {"row": "malformed", "statuses": statuses, "traceback": "Traceback" in log}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--rows", default="body,disconnect,sigint,malformed")
    ap.add_argument("--body-mb", type=float, default=50)
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    a = ap.parse_args()
    cache = a.cache.resolve()
    for row in a.rows.split(","):
        if row == "body":
            out = row_body(a.src, cache, a.body_mb, a.parallel)
        elif row == "disconnect":
            out = row_disconnect(a.src, cache, a.prompt_tokens)
        elif row == "sigint":
            out = row_sigint(a.src, cache, a.prompt_tokens)
        elif row == "malformed":
            out = row_malformed(a.src, cache)
        else:
            raise SystemExit(f"unknown row {row!r}")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
