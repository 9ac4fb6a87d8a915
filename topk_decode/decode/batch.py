"""Concurrent conversations decoded together: one model step for every one-token step asked at about the same time.

Each conversation keeps its own thread, its own sampling and its own loop (`TopKDecoder.stream`); only
its one-token `forward` changes: with a `StepBatcher` set on the decoder, the call queues a
`StepRequest` and waits. Whoever finds no batch running takes up to `max_batch` queued requests and
runs them as one step (engine.py `forward_batch`), then wakes their threads with their logits.

Batches stay whole: a conversation that was in the last batch and has not left (its answer ended:
`leave`) is waited for, up to `gather_s`, before the next batch starts without it, so B streams do
not fall apart into B batches of one (each thread samples and detokenizes its token between steps).
A new conversation joins the next batch after its prompt, which runs alone under the step lock.
docs/SERVE.md ("Batched decoding") has the design and the measurements.
"""

from __future__ import annotations

import threading
import time

from topk_decode.decode.engine import Conversation, StepRequest, TopKDecoder, forward_batch

GATHER_S = 0.05  # longest wait for a conversation of the last batch (a thread's work between steps takes ~1 ms)


class StepBatcher:
    """Gathers the one-token steps of the decoders sharing one model into batched steps.

    Args:
        max_batch: most conversations in one step.
        gather_s: how long a batch waits for a conversation of the last batch before starting without it.
    """

    def __init__(self, max_batch: int, gather_s: float = GATHER_S) -> None:
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.cond = threading.Condition()
        self.queue: list[StepRequest] = []
        self.members: set[int] = set()  # id() of the last batch's conversations that have not left
        self.busy = False
        self.batches = 0  # batched steps run, and the conversation steps in them (counts)
        self.stepped = 0

    def attach(self, decoders: list[TopKDecoder]) -> None:
        """Decode these decoders' one-token steps together (they must share one model and step lock)."""
        for d in decoders:
            if d.model is not decoders[0].model or d.lock is not decoders[0].lock:
                raise ValueError("batched decoders must share one model and one step lock")
        for d in decoders:
            d.batcher = self

    def step(self, decoder: TopKDecoder, conv: Conversation, ids: list[int]):
        """The conversation's one-token step, decoded with whatever others are asked meanwhile: (V,) logits."""
        req = StepRequest(decoder, conv, ids)
        with self.cond:
            self.queue.append(req)
            self.cond.notify_all()
            deadline = None
            while req.logits is None and req.error is None:
                if self.busy:
                    self.cond.wait()
                    continue
                queued = {id(r.conv) for r in self.queue}
                if len(self.queue) < self.max_batch and not self.members <= queued:
                    deadline = deadline or time.monotonic() + self.gather_s
                    left = deadline - time.monotonic()
                    if left > 0:
                        self.cond.wait(left)
                        continue
                batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
                self.busy = True
                self.cond.release()
                try:
                    forward_batch(batch)
                finally:
                    self.cond.acquire()
                    self.busy = False
                    self.batches += 1
                    self.stepped += len(batch)
                    self.members = {id(r.conv) for r in batch if r.error is None}
                    deadline = None
                    self.cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.logits

    def leave(self, conv: Conversation) -> None:
        """The conversation takes no more one-token steps for now: the next batch does not wait for it."""
        with self.cond:
            self.members.discard(id(conv))
            self.cond.notify_all()
