"""Request validation and OpenAI-shaped errors: every bad request becomes a 4xx JSON error, never a 500.

Hand-written checks instead of a schema library, so each error names its parameter the way the
OpenAI API does: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from topk_decode.decode.sampling import LOGIT_BIAS_MAX, PENALTY_MAX, TOP_LOGPROBS_MAX

MAX_STOP = 4  # OpenAI's limit on stop sequences
TEMPERATURE_MAX = 2.0  # OpenAI's range for temperature
# default request body limit (`topk serve --max-body-mb`): room for a prompt of the default max_window_tokens
# (65,536 tokens) even written as \uXXXX escapes; bounds the memory and parse time a request can cost
MAX_BODY_MB = 4.0
MAX_LOGIT_BIAS = 1024  # entries of logit_bias a request may give: bounds what each decoding step adds
COMPLETION_LOGPROBS_MAX = 5  # OpenAI's limit on /v1/completions' logprobs (chat's top_logprobs goes to 20)


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON.

    Args:
        status: HTTP status (4xx for the client's mistakes).
        message: what went wrong, for a person.
        param: the request parameter at fault, if any.
        code: a machine-readable code (e.g. "model_not_found").
        type: OpenAI's error type.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        """`body()` as ASCII JSON: whatever a message quotes, rendering it cannot fail."""
        return json.dumps(self.body())


@dataclass
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" or "completion"
    model: str
    messages: list[dict] = field(default_factory=list)  # chat
    prompt: str = ""  # completion
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 256
    max_tokens_given: bool = False  # False: max_tokens is the server's default, cut to the room left
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; n: each token's and its n most likely alternatives


def too_large(limit_bytes: int) -> APIError:
    """The 413 for a body past the server's limit."""
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit_bytes / 2**20:g} MB (topk serve --max-body-mb)",
        code="request_too_large",
    )


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # ValueError covers integers of over 4300 digits
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise APIError(400, f"{name} must be a number", param=name, code="invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"{name} must be in {bound}, got {v}", param=name, code="invalid_value")
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise APIError(400, f"{name} must be an integer", param=name, code="invalid_type")
    return v


def _unicode(s: str, param: str) -> str:
    """`s` if it is valid Unicode text, else a 400."""
    try:  # a JSON escape like "\\ud800" gives a lone surrogate, which the tokenizer cannot encode
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param} is not valid Unicode text: a lone surrogate ({s[e.start]!r}) at character {e.start}",
            param=param,
            code="invalid_value",
        ) from None
    return s


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return _unicode(content, param)
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise APIError(400, "only text content parts are supported", param=param, code="invalid_value")
        return _unicode("".join(p["text"] for p in content), param)
    raise APIError(400, "message content must be a string or a list of text parts", param=param, code="invalid_type")


def model_not_found(model: str, model_ids: list[str]) -> APIError:
    """The 404 for a model id this server does not serve (a request's `model`, GET /v1/models/ID).

    Args:
        model: the id asked for.
        model_ids: the ids served.
    """
    listed = ", ".join(repr(m) for m in model_ids)
    return APIError(
        404, f"the model {model!r} does not exist; this server serves {listed}", param="model", code="model_not_found"
    )


def served_model(model, model_ids: list[str]) -> str:
    """The served model a request names: `model`, or the only one when it names none (APIError otherwise).

    Args:
        model: the request's `model` (None when absent).
        model_ids: the models (caches) this server serves.
    """
    if model is None and len(model_ids) == 1:
        return model_ids[0]
    if not isinstance(model, str) or not model:
        listed = ", ".join(repr(m) for m in model_ids)
        raise APIError(
            400,
            f"model is required: one of {listed} (GET /v1/models lists them)",
            param="model",
            code="missing_required_parameter",
        )
    if model not in model_ids:
        raise model_not_found(model, model_ids)
    return model


def parse_request(
    body: dict, kind: str, model_ids: list[str], max_tokens_limit: int, default_max_tokens: int
) -> GenerationRequest:
    """Validate a chat or completion request.

    Args:
        body: the parsed JSON body.
        kind: "chat" or "completion".
        model_ids: the models (caches) this server serves; a request may omit `model` when there is one.
        max_tokens_limit: the largest max_tokens accepted.
        default_max_tokens: max_tokens when the request gives none.
    """
    req = GenerationRequest(kind=kind, model=served_model(body.get("model"), model_ids))
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(
                400,
                "messages must be a non-empty list",
                param="messages",
                code="missing_required_parameter" if messages is None else "invalid_value",
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(
                    400, f"messages[{i}] must be an object with a role", param=f"messages[{i}]", code="invalid_value"
                )
            req.messages.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
        _refuse_unsupported(body, CHAT_UNSUPPORTED)
    else:
        _refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "prompt must be a non-empty string", param="prompt", code="invalid_value")
        req.prompt = _unicode(prompt, "prompt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise APIError(400, "stream must be a boolean", param="stream", code="invalid_type")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options", code="invalid_type")
    req.include_usage = bool((options or {}).get("include_usage"))
    n = _integer(body, "n")
    if n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
    req.logprobs = _logprobs(body, kind)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name)
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        raise APIError(
            400,
            f"{name} must be between 1 and {max_tokens_limit} on this server, got {max_tokens}",
            param=name,
            code="invalid_value",
        )
    req.max_tokens = max_tokens if max_tokens is not None else default_max_tokens
    req.max_tokens_given = max_tokens is not None
    # greedy unless asked: the served caches answer questions, and greedy is the exact path
    req.temperature = _number(body, "temperature", 0.0, 0.0, TEMPERATURE_MAX)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    req.seed = _integer(body, "seed")
    # PENALTY_MAX, LOGIT_BIAS_MAX: OpenAI's ranges, the sampler's own checks (decode/sampling.py)
    req.presence_penalty = _number(body, "presence_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX)
    req.logit_bias = _logit_bias(body)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(
            400,
            f"stop must be a non-empty string or a list of at most {MAX_STOP} of them",
            param="stop",
            code="invalid_value",
        )
    req.stop = [_unicode(s, "stop") for s in stop or []]
    return req


# what a request may not ask for, as (parameter, the values that ask for nothing): refused with a 400 naming it
# rather than accepted and ignored
CHAT_UNSUPPORTED = (
    ("tools", (None, [])),
    ("tool_choice", (None, "none")),
    ("functions", (None, [])),
    ("function_call", (None, "none")),
    ("audio", (None,)),
    ("modalities", (None, ["text"])),
)
COMPLETION_UNSUPPORTED = (("echo", (None, False)), ("suffix", (None, "")), ("best_of", (None, 1)))


def _refuse_unsupported(body: dict, unsupported: tuple) -> None:
    """A 400 naming the first parameter that asks for what this server does not do."""
    for name, harmless in unsupported:
        v = body.get(name)
        if not any(v == h and type(v) is type(h) for h in harmless):
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(
            400,
            'response_format is not supported by this server (only {"type": "text"})',
            param="response_format",
            code="unsupported_parameter",
        )


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives to report per token (None: no logprobs): chat's logprobs + top_logprobs, or
    completions' logprobs count."""
    if kind == "completion":
        n = _integer(body, "logprobs")
        if n is not None and not 0 <= n <= COMPLETION_LOGPROBS_MAX:
            raise APIError(
                400,
                f"logprobs must be between 0 and {COMPLETION_LOGPROBS_MAX}, got {n}",
                param="logprobs",
                code="invalid_value",
            )
        return n
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, "logprobs must be a boolean", param="logprobs", code="invalid_type")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= TOP_LOGPROBS_MAX:
        raise APIError(
            400,
            f"top_logprobs must be between 0 and {TOP_LOGPROBS_MAX}, got {top}",
            param="top_logprobs",
            code="invalid_value",
        )
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def _logit_bias(body: dict) -> dict[int, float]:
    """{token id: bias}: OpenAI's {"id": value} with ids as strings (JSON keys) and values in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            400,
            f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids",
            param="logit_bias",
            code="invalid_value",
        )
    out = {}
    for key, v in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias", code="invalid_value"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            raise APIError(
                400,
                f"logit_bias values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {v!r}",
                param="logit_bias",
                code="invalid_value",
            )
        out[int(key)] = float(v)
    return out
