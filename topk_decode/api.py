"""The Python API: `KVStore` (prefill once, ask many times) and `ChatSession` (multi-turn)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import Conversation, TopKDecoder
from topk_decode.decode.messages import conversation_text
from topk_decode.decode.sampling import Sampling
from topk_decode.decode.sources import SourceTracker
from topk_decode.errors import TopkError
from topk_decode.model.loading import eos_token_ids, load_model, load_tokenizer, model_fingerprint
from topk_decode.prefill.build import LAST_LOGITS, build_cache, parse_dtype, pick_device
from topk_decode.prefill.documents import PromptFormat
from topk_decode.prefill.layerwise import CHUNK_SIZE
from topk_decode.store.cache_dir import ContextKV, open_cache


def decode_config(config: DecodeConfig | None = None, **fields) -> DecodeConfig:
    """`config` (default: DecodeConfig()) with the given fields replaced (None: left as it is), validated by name;
    its strategy options copied, never shared with the caller's."""
    from dataclasses import fields as dataclass_fields
    from dataclasses import replace

    known = {f.name for f in dataclass_fields(DecodeConfig) if f.name != "n_layers"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TopkError(f"unknown decoding option {unknown[0]!r}; DecodeConfig has: {', '.join(sorted(known))}")
    given = {name: value for name, value in fields.items() if value is not None}
    out = replace(config or DecodeConfig(), **given)
    out.strategy_options = dict(out.strategy_options or {})
    return out


class KVStore:
    """A prefilled context on disk, opened for top-k decoding.

    Use `KVStore.build(docs, out, model)` once, then `KVStore.open(out, k=..., strategy=...)`.
    `close()` (or a `with` block) stops the store's search threads.

    Threads: one store may be shared by any number of threads. `ask` and `generate_ids` each start
    their own conversation, and every decoding step holds a store-wide lock, so concurrent calls
    interleave step by step and each gets exactly the answer it would get alone (no speed-up: the
    model runs one token at a time anyway). A `ChatSession` belongs to one thread at a time. Opening
    a store changes no process-wide setting: its search threads set their own OpenMP thread count.
    """

    def __init__(
        self,
        ckv: ContextKV,
        model,
        tokenizer,
        config: DecodeConfig,
        progress: Callable[[int, int], None] | None = None,
        step_lock=None,
    ) -> None:
        self.ckv = ckv
        self.model = model
        self.tokenizer = tokenizer
        last = ckv.path / LAST_LOGITS
        last_logits = torch.from_numpy(np.fromfile(last, dtype=np.float32)) if last.is_file() else None
        self.requested_strategy = config.strategy  # "auto" is resolved per cache by the decoder (`append` reopens)
        self.requested_options = dict(config.strategy_options)  # the decoder adds auto's options to the config's
        self.progress = progress
        self.decoder = TopKDecoder(model, ckv, config, last_logits=last_logits, progress=progress, lock=step_lock)
        self.prompt_format = PromptFormat(**ckv.manifest.get("prompt", {"kind": "raw"}))
        self.eos_ids = eos_token_ids(model, tokenizer)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        docs: str | os.PathLike,
        out: str | os.PathLike,
        model: str | os.PathLike | None = None,
        *,
        chunk_size: int = CHUNK_SIZE,
        overwrite: bool = False,
        device: str | None = None,
        dtype: str | None = None,
        kv_dtype: str | None = None,
        allow_long_context: bool = False,
        follow_symlinks: bool = False,
        include: list[str] | tuple[str, ...] = (),
        exclude: list[str] | tuple[str, ...] = (),
        **open_kwargs,
    ) -> KVStore:
        """Prefill `docs` with `model` into the cache directory `out`, then open it.

        Args:
            docs: a documents directory (every UTF-8 text file, recursive; VCS folders, virtual
                environments, node_modules, __pycache__ and .gitignore'd paths skipped) or one file.
            out: the cache directory to create.
            model: local HF checkpoint directory or GGUF file (default: the embedded demo model).
            chunk_size: prefill chunk length.
            overwrite: replace an existing cache.
            device, dtype: compute device and dtype for the prefill (and the open).
            kv_dtype: "int8" stores the KV in 8 bits with its scales (`topk prefill --kv-dtype int8`; flat decodes
                it); None: in the model's dtype.
            allow_long_context: prefill a context longer than the model's positions (with a warning);
                by default it is refused (TopkError) before any model compute.
            follow_symlinks: also read links that leave the documents folder (skipped by default).
            include: gitignore-style patterns read even where skipped by default or by a .gitignore.
            exclude: gitignore-style patterns never read (they win over `include`).
            open_kwargs: passed to `KVStore.open` (k, strategy, ...).
        """
        if model is None:
            from topk_decode.demo import default_model_dir

            model = default_model_dir()[0]
        build_cache(
            docs,
            out,
            model,
            chunk_size=chunk_size,
            overwrite=overwrite,
            device=device,
            dtype=dtype,
            allow_long_context=allow_long_context,
            follow_symlinks=follow_symlinks,
            include=include,
            exclude=exclude,
            kv_dtype=kv_dtype,
        )
        return cls.open(out, device=device, dtype=dtype, **open_kwargs)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        k: int | None = None,
        strategy: str | None = None,
        *,
        config: DecodeConfig | None = None,
        model: str | os.PathLike | None = None,
        device: str | None = None,
        dtype: str | None = None,
        verify: bool | None = None,
        progress: Callable[[int, int], None] | None = None,
        share_model: KVStore | None = None,
        **overrides,
    ) -> KVStore:
        """Open a cache for decoding: the model goes to the device, the context KV stays memory-mapped.

        How it decodes is a `DecodeConfig` (topk_decode/config.py: k, strategy and its options, sinks and tail,
        compile, prompt chunks, window limit ...): `config`, with any of its fields given by name overriding it
        (`KVStore.open(cache, k=512, strategy="flat")`, `KVStore.open(cache, config=cfg, n_tail=128)`).

        Args:
            path: the cache directory.
            k, strategy: DecodeConfig's k and strategy ("auto", the default, picks exact `flat` on short contexts
                and `routed` on long ones; `store.strategy_reason` says which and why).
            config: the DecodeConfig to start from (default: DecodeConfig()'s defaults).
            model: checkpoint directory or GGUF file (default: the one recorded in the cache); its
                fingerprint must match.
            device: "cuda" / "cpu" (default: CUDA when available).
            dtype: compute dtype (default: bf16 on CUDA, fp32 on CPU).
            verify: hash every cache file (True), sizes only (False), or auto (None: caches ≤ 2 GiB).
            progress: callback(done, total) while the strategy builds its indices.
            share_model: an open store of a cache made with the same model: this store decodes with its
                model, tokenizer and step lock (the weights once on the device; `model`, `device` and
                `dtype` are then its). A cache of another model is a TopkError.
            **overrides: DecodeConfig fields by name (k_per_layer, k_schedule, strategy_options, n_sink, n_tail,
                compile, prompt_chunk, prompt_scratch_mib, max_window_tokens, host_embedding); another name is
                a TopkError naming them.
        """
        config = decode_config(config, k=k, strategy=strategy, **overrides)
        ckv = open_cache(path, verify=verify)
        config.validate(ckv.n_layers)
        recorded = ckv.manifest["model"]
        if share_model is not None:
            theirs = share_model.ckv.manifest["model"]
            if recorded["fingerprint"] != theirs["fingerprint"]:
                raise TopkError(
                    f"{path} was made with {recorded['path']} (fingerprint {recorded['fingerprint']}), "
                    f"not the model of {share_model.ckv.path} ({theirs['fingerprint']})"
                )
            return cls(
                ckv, share_model.model, share_model.tokenizer, config, progress, step_lock=share_model.decoder.lock
            )
        model_dir = Path(model) if model is not None else Path(recorded["path"])
        if model is None and not model_dir.exists():
            raise TopkError(f"the cache's model {model_dir} is not there any more; pass --model DIR")
        fp = model_fingerprint(model_dir)
        if fp != recorded["fingerprint"]:
            raise TopkError(
                f"model {model_dir} (fingerprint {fp}) is not the model this cache was built with "
                f"({recorded['path']}, fingerprint {recorded['fingerprint']})"
            )
        dev = pick_device(device)
        return cls(ckv, load_model(model_dir, dev, parse_dtype(dtype)), load_tokenizer(model_dir), config, progress)

    def append(
        self,
        docs: str | os.PathLike,
        *,
        model: str | os.PathLike | None = None,
        chunk_size: int | None = None,
        device: str | None = None,
        allow_long_context: bool = False,
        follow_symlinks: bool = False,
        include: list[str] | tuple[str, ...] = (),
        exclude: list[str] | tuple[str, ...] = (),
        strategies: dict[str, dict] | None = None,
    ) -> KVStore:
        """Add documents to this store's cache (`topk prefill DOCS --append CACHE`) and return the store over it.

        The model runs over the new documents only; the cache, swapped in atomically, equals a prefill of
        its documents followed by these (prefill/append.py). This store keeps answering over the old
        documents until closed; the one returned shares its model and settings.

        Args:
            docs: a documents directory or one file (read as `build` reads them); names the cache already
                holds are refused (TopkError).
            model: the checkpoint (default: the one the cache records; its fingerprint must match).
            chunk_size: prefill chunk length (default: the cache's own).
            device: where the new documents are prefilled (default: CUDA when available).
            allow_long_context, follow_symlinks, include, exclude: as for `build`.
            strategies: strategy name → build options of artifacts to build as well (those the cache has,
                and auto's choice for the new length, are rebuilt for the appended cache anyway).
        """
        from dataclasses import replace

        from topk_decode.prefill.append import append_cache

        path, _, _ = append_cache(
            docs,
            self.ckv.path,
            model,
            chunk_size=chunk_size,
            device=device,
            allow_long_context=allow_long_context,
            follow_symlinks=follow_symlinks,
            include=include,
            exclude=exclude,
            strategies=strategies,
        )
        config = replace(self.config, strategy=self.requested_strategy, strategy_options=dict(self.requested_options))
        return KVStore(open_cache(path), self.model, self.tokenizer, config, self.progress)

    def close(self) -> None:
        """Stop the store's search threads (idempotent); decoding afterwards raises TopkError."""
        self.decoder.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- facts ----------------------------------------------------------------------------------
    @property
    def context_ids(self) -> list[int]:
        """The cached context's token ids."""
        return self.ckv.tokens

    @property
    def documents(self) -> list[dict]:
        """The document table: name and token span of each document (and "places", where its pages,
        slides, sheets ... start, for a document that has them)."""
        return self.ckv.manifest["documents"]

    @property
    def config(self) -> DecodeConfig:
        return self.decoder.config

    def set_k(self, k: int) -> None:
        """Change the retrieval budget (all layers) for subsequent steps."""
        if not isinstance(k, int) or k <= 0:
            raise TopkError(f"k must be a positive integer, got {k}")
        with self.decoder.lock:  # between steps, never inside one
            self.decoder.config.k, self.decoder.config.k_per_layer = k, None

    def document_of(self, position: int) -> str | None:
        """Name of the document holding a context position (for citations)."""
        for d in self.documents:
            if d["start"] <= position < d["end"]:
                return d["name"]
        return None

    # ---- decoding -------------------------------------------------------------------------------
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 32) -> list[int]:
        """Greedy continuation of context + prompt_ids (a fresh conversation each call).

        Args:
            prompt_ids: tokens appended after the cached context.
            max_new_tokens: at most this many new tokens (stops after an eos token, which is included).
        """
        conv = self.decoder.new_conversation()
        return self.decoder.generate(conv, list(prompt_ids), max_new_tokens, self.eos_ids)

    def ask(
        self,
        question: str,
        max_new_tokens: int = 256,
        stream: bool = False,
        *,
        system: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        return_sources: bool = False,
    ) -> str | Iterator[str] | tuple[str, list[dict]]:
        """Answer one question about the context (a fresh conversation each call).

        Args:
            question: the question text; the chat template is applied where the tokenizer has one.
            max_new_tokens: answer length limit in tokens.
            stream: return an iterator of text pieces as they are generated.
            system: a system prompt (placed after the documents: see decode/messages.py).
            temperature, top_p, seed: sampling (temperature 0, the default, is greedy and exact).
            return_sources: return (answer, sources), sources = [{"document", "weight"}] by share of the
                retrieved attention mass, with "place" ("p. 12", "slide 3" ...) where the document table
                records places (decode/sources.py); needs stream=False.
        """
        _check_max_new_tokens(max_new_tokens)  # before a session is made
        if return_sources and stream:
            raise TopkError("return_sources needs stream=False (a streamed session has .sources once it ends)")
        chat = self.session(system=system, temperature=temperature, top_p=top_p, seed=seed, sources=return_sources)
        answer = chat.ask(question, max_new_tokens=max_new_tokens, stream=stream)
        return (answer, chat.sources) if return_sources else answer

    def session(
        self,
        system: str | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        sources: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
    ) -> ChatSession:
        """A multi-turn conversation with its own GPU window over this shared store (see ChatSession)."""
        return ChatSession(
            self,
            system=system,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            sources=sources,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=logprobs,
        )

    def info(self) -> dict:
        """Facts about the store (model, sizes, strategy)."""
        m = self.ckv.manifest
        return {
            "path": str(self.ckv.path),
            "model": m["model"],
            "n_tokens": self.ckv.n_tokens,
            "documents": len(m["documents"]),
            "bytes_on_disk": self.ckv.nbytes(),
            "strategy": self.config.strategy,
            "strategy_reason": self.strategy_reason,
            "k": self.config.k,
        }

    @property
    def strategy_reason(self) -> str:
        """Why the running strategy runs: chosen by the user, or `auto`'s choice for this context."""
        return self.decoder.strategy_reason


def _check_max_new_tokens(max_new_tokens) -> int:
    """The answer length limit as given, if a positive integer; else TopkError (0 or -5 would answer '' in silence)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise TopkError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return int(max_new_tokens)


def _question_text(question) -> str:
    """The question as valid text: str (or UTF-8 bytes), no lone surrogates, not empty; else TopkError."""
    if isinstance(question, (bytes, bytearray)):
        try:
            question = bytes(question).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TopkError(f"the question is not valid UTF-8 (byte {e.start})") from None
    if not isinstance(question, str):
        raise TopkError(f"the question must be text, got {type(question).__name__}")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as e:
        # e.g. a terminal or file read with errors="surrogateescape" that held invalid UTF-8
        raise TopkError(f"the question is not valid UTF-8 text (character {e.start}: {question[e.start]!r})") from None
    if not question.strip():
        raise TopkError("empty question")
    return question


class ChatSession:
    """A conversation over a KVStore: turns accumulate in its own window; `reset()` starts over.

    Args:
        store: the opened KVStore.
        system: a system prompt for the conversation, rendered by the chat template right after the
            documents (a system turn cannot precede them without prefilling again: decode/messages.py).
        temperature, top_p, seed: sampling for every answer (temperature 0, the default, is greedy);
            the seed seeds one generator for the whole conversation.
        sources: track which documents each answer drew on (`.sources` after an answer).
        presence_penalty, frequency_penalty, logit_bias: OpenAI's adjustments of the logits before each pick,
            the penalties counting the tokens of the answer so far (decode/sampling.py).
        logprobs: None, or record each answer token's log-probability and this many most likely
            alternatives in `self.sampling.picked` (0 to 20).
    """

    def __init__(
        self,
        store: KVStore,
        system: str | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        sources: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
    ) -> None:
        self.store = store
        self.system = system if system and system.strip() else None
        sampling = Sampling(
            temperature,
            top_p,
            seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=logprobs,
        )
        self.sampling = None if sampling.plain else sampling  # None keeps greedy on the exact argmax path
        self.conv: Conversation = store.decoder.new_conversation()
        self.turns = 0
        self.tracker = None
        if sources:
            shape = store.decoder.shape
            self.tracker = SourceTracker(store.documents, store.decoder.scale, shape.group_size, shape.n_layers)
            self.conv.observer = self.tracker
        self.finish_reason: str | None = None  # "stop" (end of turn) or "length" after an answer
        self.n_generated = 0  # tokens generated by the last answer

    @property
    def sources(self) -> list[dict]:
        """The documents the last answer drew on: [{"document", "weight"}], largest share first
        (decode/sources.py); empty unless the session was made with sources=True."""
        return self.tracker.sources() if self.tracker is not None else []

    @property
    def stats(self) -> dict:
        """Per-step timing means and strategy counters of this conversation."""
        s = self.conv.stats.summary()
        s["window_tokens"] = self.conv.window.n_new
        s["strategy_searches"] = self.store.decoder.strategy.stats.searches
        s["strategy_reused"] = self.store.decoder.strategy.stats.reused
        # strategy-specific counters, e.g. TokenSelect's selection-cache hit rate, Duo's skipped heads
        s.update({f"strategy_{k}": v for k, v in self.store.decoder.strategy.stats.extra.items()})
        return s

    def reset(self) -> None:
        """Forget the conversation (the context stays)."""
        self.conv.window.reset()
        self.conv.pending = []
        self.conv.strategy_state = self.store.decoder.strategy.new_state()
        self.turns = 0
        if self.tracker is not None:
            self.tracker.reset()

    def mark(self) -> tuple:
        """The conversation's position now, for `rewind`: turns, pending token, window length, sampler state."""
        rng = self.sampling.generator.get_state() if self.sampling is not None else None
        return self.turns, list(self.conv.pending), self.conv.window.length, rng

    def rewind(self, mark: tuple) -> None:
        """Back to a `mark()` of this conversation, which has only grown since (no `reset`): every token
        added after the mark is dropped, so a question interrupted midway leaves no trace."""
        self.turns, pending, length, rng = mark
        self.conv.pending = list(pending)
        self.conv.window.length = length
        if rng is not None:
            self.sampling.generator.set_state(rng)

    def _question_ids(self, question: str) -> list[int]:
        if self.turns == 0 and self.system is not None:
            text = conversation_text(
                [{"role": "system", "content": self.system}, {"role": "user", "content": question}],
                self.store.prompt_format,
                self.store.tokenizer,
            )
        else:
            text = self.store.prompt_format.question_text(question, first_turn=self.turns == 0)
        ids = self.store.tokenizer(text, add_special_tokens=False).input_ids
        # A template's turn separator usually starts with the end-of-turn token the model just emitted.
        if self.conv.pending and ids and ids[0] == self.conv.pending[0]:
            self.conv.pending = []
        return ids

    def ask(self, question: str, max_new_tokens: int = 256, stream: bool = False) -> str | Iterator[str]:
        """Answer a question, continuing the conversation.

        Args:
            question: the user's message.
            max_new_tokens: answer length limit in tokens.
            stream: return an iterator of text pieces as they are generated.
        """
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        question = _question_text(question)
        before = (self.turns, list(self.conv.pending))
        ids = self._question_ids(question)
        self.turns += 1
        pieces = self._stream(ids, max_new_tokens, before)
        return pieces if stream else "".join(pieces).strip()

    def reply(self, messages: list[dict], max_new_tokens: int = 256) -> Iterator[str]:
        """Stream the answer to a whole conversation (OpenAI-style messages) in this fresh session.

        Args:
            messages: [{"role", "content"}, ...] ending with the user's; rendered after the documents by
                the chat template (decode/messages.py). The session's own `system` is not added: a
                system prompt goes in `messages`.
            max_new_tokens: answer length limit in tokens.
        """
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        if self.turns:
            raise TopkError("reply() starts a conversation: call it on a fresh session (or after reset())")
        text = conversation_text(messages, self.store.prompt_format, self.store.tokenizer)
        before = (self.turns, list(self.conv.pending))
        self.turns = sum(m.get("role") == "user" for m in messages)
        return self._stream(self.store.tokenizer(text, add_special_tokens=False).input_ids, max_new_tokens, before)

    def complete(self, text: str | list[int], max_new_tokens: int = 256) -> Iterator[str]:
        """Stream the continuation of `text` appended verbatim after the cached documents (a fresh session).

        Args:
            text: raw text, no template applied, or its token ids (already tokenized by the caller).
            max_new_tokens: continuation length limit in tokens.
        """
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        if self.turns:
            raise TopkError("complete() needs a fresh session (or reset())")
        ids = list(text) if isinstance(text, list) else self.store.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise TopkError("empty prompt")
        before = (self.turns, list(self.conv.pending))
        self.turns = 1
        return self._stream(ids, max_new_tokens, before)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as it would be appended after the context."""
        return len(self.store.tokenizer(text, add_special_tokens=False).input_ids)

    def _stream(
        self, prompt_ids: list[int], max_new_tokens: int, before: tuple[int, list[int]] | None = None
    ) -> Iterator[str]:
        """Generate and detokenize incrementally (byte-level merges can complete later).

        Args:
            prompt_ids: the question's tokens.
            max_new_tokens: answer length limit.
            before: (turns, pending) before the question: restored when its prompt step fails (e.g. too long).
        """
        tok, eos = self.store.tokenizer, self.store.eos_ids
        out: list[int] = []
        shown = ""
        self.finish_reason, self.n_generated = "length", 0
        if self.tracker is not None:
            self.tracker.reset()
        if self.sampling is not None:
            self.sampling.start_answer()
        steps = self.store.decoder.stream(self.conv, prompt_ids, max_new_tokens, eos, self.sampling)
        try:
            first = next(steps, None)
        except BaseException:
            if before is not None:
                self.turns, self.conv.pending = before  # the decoder left the window as it was
            raise
        for t in itertools.chain([] if first is None else [first], steps):
            self.n_generated += 1
            if t in eos:
                self.finish_reason = "stop"
                break
            out.append(t)
            text = tok.decode(out, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            yield text[len(shown) :]
            shown = text
        text = tok.decode(out, skip_special_tokens=True)
        if len(text) > len(shown):
            yield text[len(shown) :]
