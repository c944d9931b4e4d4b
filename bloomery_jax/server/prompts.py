"""Validated requests → what the scheduler takes: prompt ids, sampling params, stop conditions.

Contract. :func:`prepare_chat` and :func:`prepare_completion` take a parsed request (schemas)
and the loaded :class:`ModelBundle`, and return a :class:`Prepared` or raise APIError(400)
naming the field: an unknown model name (``model``), a prompt that does not fit the context
(``messages`` / ``prompt``, code ``context_length_exceeded``), a token id outside the
vocabulary (``prompt[i]``, ``logit_bias``), a template that fails on these messages
(``messages``), options we do not implement (``echo``, ``suffix``, ``response_format``).

Defaults for fields a request leaves out are llama-server's (temperature 0.8, top-k 40,
top-p 0.95, min-p 0.05); ``max_tokens`` defaults to the rest of the context. A request without
a seed gets a random one.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading

from ..chat import ChatTemplate, ChatTemplateError
from ..engine.sampling import SamplingParams, row_arrays
from ..engine.stops import StopConditions
from ..errors import ConfigError
from .errors import bad_request
from .schemas import ChatRequest, CompletionRequest

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "range",
                       "namespace", "raise_exception", "strftime_now", "tojson", "dict", "lipsum", "cycler",
                       "joiner"})


@dataclasses.dataclass
class ModelBundle:
    """What the prompt side needs of the loaded model."""

    model_id: str
    names: frozenset[str]  # names a request may give in ``model``
    tokenizer: object  # bloomery_jax.tokenizer.Tokenizer
    template: ChatTemplate
    n_ctx: int
    n_vocab: int
    # ChatTemplate keeps per-render limits on itself: one render at a time.
    template_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams
    stop: StopConditions
    logprobs: bool  # report log-probabilities of the generated tokens
    stream: bool
    include_usage: bool
    time_limit: float | None = None  # the request's own limit in seconds (capped by the server's)


def check_model(bundle: ModelBundle, name: str | None) -> None:
    if name is not None and name not in bundle.names:
        raise bad_request(f"model {name!r} is not served here (this server serves {bundle.model_id!r})",
                          param="model", code="model_not_found")


def sampling_params(bundle: ModelBundle, req, n_probs: int) -> SamplingParams:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        tok = int(key)
        if not 0 <= tok < bundle.n_vocab:
            raise bad_request(f"logit_bias: token id {tok} is not in [0, {bundle.n_vocab})", param="logit_bias",
                              code="invalid_value")
        bias[tok] = value
    pick = lambda name: getattr(req, name) if getattr(req, name) is not None else DEFAULTS[name]  # noqa: E731
    rep = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    params = SamplingParams(
        temperature=pick("temperature"), top_k=pick("top_k"), top_p=pick("top_p"), min_p=pick("min_p"),
        repetition_penalty=rep if rep is not None else 1.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias, seed=req.seed if req.seed is not None else secrets.randbits(63), n_probs=n_probs)
    try:
        params.validate(bundle.n_vocab)
        # A dry run of the conversion the worker does at admission: a value that cannot become
        # a device array must fail this request here, never the engine thread.
        row_arrays(params, bundle.n_vocab)
    except (ConfigError, OverflowError, ValueError, TypeError) as e:
        raise bad_request(f"sampling parameters: {e}", code="invalid_value") from None
    return params


def _stop(bundle: ModelBundle, req, n_prompt: int, field: str) -> StopConditions:
    room = bundle.n_ctx - n_prompt
    if room < 1:
        raise bad_request(f"{field}: the prompt is {n_prompt} tokens and the context holds {bundle.n_ctx}; "
                          f"it must be shorter than the context", param=field, code="context_length_exceeded")
    limit = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return StopConditions.build(max_tokens=min(limit or room, room), stop_tokens=bundle.tokenizer.eog_ids,
                                stop_strings=req.stop or ())


def _message_dict(m) -> dict:
    d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            args = c.function.arguments
            if isinstance(args, str):  # templates expect an object; OpenAI sends a JSON string
                try:
                    parsed = json.loads(args)
                    args = parsed if isinstance(parsed, dict) else args
                except ValueError:
                    pass
            calls.append({"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    return d


def render_chat(bundle: ModelBundle, req: ChatRequest) -> str:
    """The prompt text of a chat request (the model's template)."""
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format type {req.response_format.get('type')!r} is not supported "
                          "(only 'text')", param="response_format", code="unsupported")
    tools = None
    if req.tools and req.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    extra = dict(req.chat_template_kwargs or {})
    for name in list(extra):  # data only: never shadow the variables and helpers the template is given
        if name in _RESERVED or name.startswith("_"):
            raise bad_request(f"chat_template_kwargs: {name!r} may not be set", param="chat_template_kwargs",
                              code="invalid_value")
    messages = [_message_dict(m) for m in req.messages]
    try:
        with bundle.template_lock:
            return bundle.template.render(messages, tools=tools, add_generation_prompt=True, **extra)
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", param="messages", code="template_error") from None


def encode_prompt(bundle: ModelBundle, text: str) -> list[int]:
    """Ids of a rendered chat prompt: special-token texts parsed, BOS added once if the file wants it."""
    tok = bundle.tokenizer
    ids = tok.encode(text, add_special=False, parse_special=True)
    if tok.vocab.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids


def prepare_chat(bundle: ModelBundle, req: ChatRequest) -> Prepared:
    check_model(bundle, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
    n_probs = (req.top_logprobs or 0) if req.logprobs else 0
    params = sampling_params(bundle, req, n_probs)
    ids = encode_prompt(bundle, render_chat(bundle, req))
    if not ids:
        raise bad_request("messages: the rendered prompt is empty", param="messages", code="invalid_value")
    return Prepared(ids, params, _stop(bundle, req, len(ids), "messages"), req.logprobs, req.stream,
                    req.include_usage, req.timeout)


def prepare_completion(bundle: ModelBundle, req: CompletionRequest) -> Prepared:
    check_model(bundle, req.model)
    if req.echo:
        raise bad_request("echo: true is not supported", param="echo", code="unsupported")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request(f"prompt: one prompt per request (got {len(prompt)})", param="prompt",
                              code="unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = bundle.tokenizer.encode(prompt, add_special=True, parse_special=True)
    else:
        for i, t in enumerate(prompt):
            if not 0 <= t < bundle.n_vocab:
                raise bad_request(f"prompt[{i}]: token id {t} is not in [0, {bundle.n_vocab})",
                                  param=f"prompt[{i}]", code="invalid_value")
        ids = list(prompt)
    if not ids:
        raise bad_request("prompt: is empty (it needs at least one token)", param="prompt", code="invalid_value")
    n_probs = req.logprobs or 0
    params = sampling_params(bundle, req, n_probs)
    return Prepared(ids, params, _stop(bundle, req, len(ids), "prompt"), req.logprobs is not None, req.stream,
                    req.include_usage, req.timeout)
