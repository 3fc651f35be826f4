"""Request parsing and response shaping for the embedded worker's SGLang-style `/generate`.

Kept apart from the HTTP layer and the generation loop so that the wire format (what SGLang
clients such as slime send and read) lives in one place. Parsing is strict on purpose: a field
this worker would silently ignore (a penalty, a grammar) is answered with HTTP 400 instead of a
plausible-looking but different result, because callers train on these outputs.

`sampling_params.n = k` (SGLang's parallel sampling) asks for k completions of each prompt: the
answer is then a list of k result objects per prompt, prompt-major (prompt i's sample j at
i * k + j), as SGLang sends it, even for a single prompt. The k rows share one prefill.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp.http_exceptions import BadHttpMessage

# Below this temperature a request is greedy (SGLang uses the same convention).
GREEDY_TEMPERATURE_THRESHOLD = 1e-6
DEFAULT_MAX_NEW_TOKENS = 128
# Most completions one request may ask for per prompt (`sampling_params.n`): a bound on the rows
# one request can occupy, not a limit of the engine.
MAX_PARALLEL_SAMPLES = 1024

# Sampling fields SGLang accepts that this worker does not implement, with the value that makes
# them a no-op. A request that sets one to anything else gets HTTP 400. (`n` is handled by
# `parse_generate_request` before the rest is parsed; the OpenAI routes serve one choice only.)
_NO_OP_SAMPLING_FIELDS: dict[str, Any] = {
    "n": 1,
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "sampling_seed": None,
}
# Fields that only change detokenisation details we do not distinguish; accepted and ignored.
_IGNORED_SAMPLING_FIELDS = frozenset({"spaces_between_special_tokens", "stream_interval"})
_HANDLED_TOP_LEVEL_FIELDS = frozenset(
    {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid"}
)
# Accepted whatever their value because they do not change what is generated. (With
# return_text_in_logprobs the third element of each log-prob triple stays null.)
_HARMLESS_TOP_LEVEL_FIELDS = frozenset({"model", "log_metrics", "no_logs", "return_text_in_logprobs", "priority"})


def _is_unset(value: Any) -> bool:
    """sglang-router re-serialises requests with every optional field at its default (null/false)."""
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


class RequestError(Exception):
    """A malformed or unsatisfiable request: answered with HTTP 400 and this message."""


# SGLang's limits on one request's length, kept here so that what this worker serves an SGLang
# server serves too (a client tested against this worker must not meet its first HTTP 400 on a
# cluster): its tokenizer manager refuses a prompt plus max_new_tokens that reaches the context
# length (equal is refused, not only more), and its scheduler aborts a prompt that reaches the
# context less this many tokens (its largest input is the context - 1, less 5 more).
SGLANG_INPUT_MARGIN = 6


def context_length_error(prompt_tokens: int, max_new_tokens: int, context_length: int | None) -> str | None:
    """Why SGLang would refuse this request for its length, or None when it fits."""
    if context_length is None:
        return None
    if prompt_tokens + max_new_tokens >= context_length:
        return (
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) reaches the model's context "
            f"length ({context_length}); SGLang serves at most {context_length - 1} tokens in all"
        )
    if prompt_tokens >= context_length - SGLANG_INPUT_MARGIN:
        return (
            f"prompt ({prompt_tokens} tokens) is too long for the model's context length ({context_length}); "
            f"SGLang serves prompts of at most {context_length - SGLANG_INPUT_MARGIN - 1} tokens"
        )
    return None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD


@dataclass(frozen=True)
class GenerationSpec:
    """One prompt's worth of work, validated; the generation loop needs nothing else."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output log-probs only
    top_logprobs_num: int = 0
    # Specs with the same key are the k samples of one prompt sent with `n = k`: the generation
    # loop prefills that prompt once and copies its KV cache into the k rows.
    shared_prefill: str | None = None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)


@dataclass
class FinishedGeneration:
    """What the generation loop hands back for one spec; `generate_response` makes it JSON."""

    spec: GenerationSpec
    output_ids: list[int]
    finish_reason: dict[str, Any]
    text: str
    weight_version: str
    e2e_latency: float
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # One entry per input position from logprob_start_len on; None where undefined (position 0).
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RequestError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(value: Any, name: str) -> float:
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"sampling_params.{name} must be a finite number",
    )
    return float(value)


def parse_sampling_params(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    _require(isinstance(raw, dict), "sampling_params must be an object")
    for name, no_op_value in _NO_OP_SAMPLING_FIELDS.items():
        if name in raw and raw[name] is not None and raw[name] != no_op_value:
            raise RequestError(f"sampling_params.{name}={raw[name]!r} is not supported by this worker")
    known = {f for f in SamplingParams.__dataclass_fields__} | set(_NO_OP_SAMPLING_FIELDS)
    unknown = sorted(name for name in set(raw) - known - _IGNORED_SAMPLING_FIELDS if not _is_unset(raw[name]))
    _require(not unknown, f"sampling_params field(s) not supported by this worker: {', '.join(unknown)}")

    max_new_tokens = raw.get("max_new_tokens")
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    _require(_is_int(max_new_tokens) and max_new_tokens >= 0, "sampling_params.max_new_tokens must be an integer >= 0")
    temperature = _as_float(raw.get("temperature", 1.0), "temperature")
    _require(temperature >= 0, "sampling_params.temperature must be >= 0")
    top_p = _as_float(raw.get("top_p", 1.0), "top_p")
    _require(0 < top_p <= 1, "sampling_params.top_p must be in (0, 1]")
    top_k = raw.get("top_k", -1)
    _require(_is_int(top_k) and (top_k == -1 or top_k >= 1), "sampling_params.top_k must be -1 or an integer >= 1")

    stop = raw.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    _require(
        isinstance(stop, list) and all(isinstance(s, str) for s in stop),
        "sampling_params.stop must be a string or a list of strings",
    )
    stop_token_ids = raw.get("stop_token_ids") or []
    _require(
        isinstance(stop_token_ids, list) and all(_is_int(t) for t in stop_token_ids),
        "sampling_params.stop_token_ids must be a list of integers",
    )
    flags = {}
    for name, default in (("ignore_eos", False), ("skip_special_tokens", True), ("no_stop_trim", False)):
        value = raw.get(name, default)
        _require(isinstance(value, bool), f"sampling_params.{name} must be true or false")
        flags[name] = value
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(s for s in stop if s),  # an empty stop string would match everywhere
        stop_token_ids=frozenset(stop_token_ids),
        **flags,
    )


def _per_item(value: Any, count: int, name: str, is_batch: bool) -> list[Any]:
    """SGLang lets batch requests give one value for all items or a list with one per item."""
    if is_batch and isinstance(value, list):
        _require(len(value) == count, f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _parallel_samples(raw: Any) -> tuple[int, Any]:
    """SGLang's `sampling_params.n`: (samples per prompt, the sampling params without `n`)."""
    if not isinstance(raw, dict) or raw.get("n") is None:
        return 1, raw
    n = raw["n"]
    _require(
        _is_int(n) and 1 <= n <= MAX_PARALLEL_SAMPLES,
        f"sampling_params.n must be an integer in [1, {MAX_PARALLEL_SAMPLES}]",
    )
    return n, {name: value for name, value in raw.items() if name != "n"}


def parse_generate_request(
    body: Any,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    max_positions: int | None,
) -> tuple[list[GenerationSpec], bool]:
    """Validate a `/generate` body. Returns the specs and whether the answer is a list.

    With `sampling_params.n = k > 1` each prompt becomes k specs sharing a prefill key, and the
    answer is a list (SGLang turns a single prompt with n > 1 into a batch of one).
    """
    _require(isinstance(body, dict), "request body must be a JSON object")
    unsupported = sorted(
        name
        for name, value in body.items()
        if name not in _HANDLED_TOP_LEVEL_FIELDS and name not in _HARMLESS_TOP_LEVEL_FIELDS and not _is_unset(value)
    )
    _require(not unsupported, f"field(s) not supported by this worker: {', '.join(unsupported)}")
    text, input_ids = body.get("text"), body.get("input_ids")
    _require((text is None) != (input_ids is None), "give exactly one of 'text' or 'input_ids'")

    prompts: list[list[int]]
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        _require(all(isinstance(t, str) for t in texts), "'text' must be a string or a list of strings")
        prompts = [list(encode(t)) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        for prompt in prompts:
            _require(
                isinstance(prompt, list) and all(_is_int(t) and 0 <= t < vocab_size for t in prompt),
                f"'input_ids' must be a list of token ids in [0, {vocab_size}) or a list of such lists",
            )
    _require(len(prompts) > 0, "empty batch")

    count = len(prompts)
    sampling_items = _per_item(body.get("sampling_params"), count, "sampling_params", is_batch)
    parallel = [_parallel_samples(raw) for raw in sampling_items]
    samples_per_prompt = parallel[0][0]
    _require(all(n == samples_per_prompt for n, _ in parallel), "sampling_params.n must be the same for every prompt")
    sampling_raw = [raw for _, raw in parallel]
    rids = _per_item(body.get("rid"), count, "rid", is_batch)
    return_logprob = body.get("return_logprob", False)
    _require(isinstance(return_logprob, bool), "'return_logprob' must be true or false")
    logprob_start_len = body.get("logprob_start_len", -1)
    _require(_is_int(logprob_start_len) and logprob_start_len >= -1, "'logprob_start_len' must be an integer >= -1")
    top_logprobs_num = body.get("top_logprobs_num", 0) or 0
    _require(
        _is_int(top_logprobs_num) and 0 <= top_logprobs_num <= vocab_size,
        f"'top_logprobs_num' must be an integer in [0, {vocab_size}]",
    )

    specs = []
    for prompt, raw_sampling, rid in zip(prompts, sampling_raw, rids):
        _require(len(prompt) > 0, "a prompt must have at least one token")
        sampling = parse_sampling_params(raw_sampling)
        length_error = context_length_error(len(prompt), sampling.max_new_tokens, max_positions)
        if length_error is not None:
            raise RequestError(length_error)
        _require(rid is None or isinstance(rid, str), "'rid' must be a string or a list of strings")
        base_rid = rid or uuid.uuid4().hex
        prefill_key = uuid.uuid4().hex if samples_per_prompt > 1 else None  # unique even if a caller reuses a rid
        for sample in range(samples_per_prompt):
            specs.append(
                GenerationSpec(
                    rid=base_rid if samples_per_prompt == 1 else f"{base_rid}-{sample}",
                    input_ids=tuple(prompt),
                    sampling=sampling,
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num if return_logprob else 0,
                    shared_prefill=prefill_key,
                )
            )
    return specs, is_batch or samples_per_prompt > 1


def render_output_text(
    decode: Callable[[Sequence[int], bool], str],
    output_ids: Sequence[int],
    finish_reason: dict[str, Any],
    sampling: SamplingParams,
) -> str:
    """Text of the output, with the matched stop token or stop string trimmed as SGLang does."""
    matched = finish_reason.get("matched")
    trim = finish_reason.get("type") == "stop" and not sampling.no_stop_trim
    if trim and isinstance(matched, int) and output_ids:
        return decode(output_ids[:-1], sampling.skip_special_tokens)
    text = decode(output_ids, sampling.skip_special_tokens)
    if trim and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def _triples(pairs: Sequence[tuple[float, int]]) -> list[list[Any]]:
    return [[logprob, token_id, None] for logprob, token_id in pairs]


def generate_response(result: FinishedGeneration) -> dict[str, Any]:
    spec = result.spec
    meta_info: dict[str, Any] = {
        "id": spec.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(spec.input_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": result.e2e_latency,
    }
    if spec.return_logprob:
        start = spec.logprob_start_len if spec.wants_input_logprobs else len(spec.input_ids)
        input_ids = spec.input_ids[start:]
        meta_info["input_token_logprobs"] = [
            [logprob, token_id, None] for logprob, token_id in zip(result.input_logprobs, input_ids)
        ]
        meta_info["output_token_logprobs"] = [
            [logprob, token_id, None] for logprob, token_id in zip(result.output_logprobs, result.output_ids)
        ]
        if spec.top_logprobs_num > 0:
            meta_info["input_top_logprobs"] = [
                None if top is None else _triples(top) for top in result.input_top_logprobs
            ]
            meta_info["output_top_logprobs"] = [_triples(top) for top in result.output_top_logprobs]
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta_info}


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


class RouterHttp2ProbeFilter(logging.Filter):
    """Drop aiohttp's error log for sglang-router's HTTP/2 probe.

    When a worker registers, the router first tries an HTTP/2 (gRPC) connection; aiohttp
    rejects the preface, logs a traceback at ERROR, and the router falls back to HTTP/1.1.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, BadHttpMessage) and "PRI" in str(error))
