"""Response bodies in OpenAI's shapes, SSE framing, log-probabilities and llama-server timings.

Contract. Non-streaming: :func:`chat_response` (``chat.completion``) and
:func:`completion_response` (``text_completion``). Streaming: :func:`sse` frames one JSON
object as ``data: {...}\\n\\n``; a stream is a ``chat.completion.chunk`` with the assistant role,
content chunks, a last chunk with ``finish_reason`` (and ``timings``), an optional usage chunk
with no choices (``stream_options.include_usage``), then :data:`SSE_DONE`. Log-probabilities
are the model's raw distribution (engine/sampling.py); the chat shape lists
``{token, logprob, bytes, top_logprobs}`` per token, the legacy completion shape
``tokens / token_logprobs / top_logprobs / text_offset``.
"""

from __future__ import annotations

import json

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(job, reason: str) -> str:
    """The scheduler's reason in OpenAI's words (a time limit reads as ``length``)."""
    if reason == "cancelled" and job.timed_out:
        return "length"
    return reason


def usage(job) -> dict:
    n_prompt, n_gen = len(job.request.prompt), len(job.request.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def timings(job) -> dict:
    """llama-server's ``timings`` object from the scheduler's per-request clock."""
    t = job.request.timings
    prompt_ms = (t.prompt_s or 0.0) * 1e3
    decode_ms = (t.decode_s or 0.0) * 1e3
    n_dec = max(t.n_generated - 1, 0)  # the first token comes out of the prefill
    return {
        "prompt_n": t.n_prompt, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / t.n_prompt if t.n_prompt and prompt_ms else 0.0,
        "prompt_per_second": t.prompt_tps or 0.0,
        "predicted_n": t.n_generated, "predicted_ms": decode_ms,
        "predicted_per_token_ms": decode_ms / n_dec if n_dec and decode_ms else 0.0,
        "predicted_per_second": t.decode_tps or 0.0,
        "queue_ms": ((t.t_admit - t.t_submit) * 1e3) if t.t_admit is not None else None,
    }


def _extras(job) -> dict:
    out = {"timings": timings(job)}
    if job.timed_out:
        out["stopped_by"] = "time_limit"
    return out


# --- log-probabilities ---------------------------------------------------------------------
def _piece(tokenizer, token: int) -> tuple[str, list[int]]:
    data = tokenizer.token_bytes(token, special=True)
    return data.decode("utf-8", errors="replace"), list(data)


def chat_logprob(tokenizer, ev) -> dict:
    text, data = _piece(tokenizer, ev.token)
    top = []
    for tid, lp in ev.top_logprobs:
        t_text, t_data = _piece(tokenizer, tid)
        top.append({"token": t_text, "logprob": lp, "bytes": t_data})
    return {"token": text, "logprob": ev.logprob, "bytes": data, "top_logprobs": top}


class CompletionLogprobs:
    """The legacy ``logprobs`` object, built token by token."""

    def __init__(self):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, tokenizer, ev, offset: int) -> None:
        self.tokens.append(_piece(tokenizer, ev.token)[0])
        self.token_logprobs.append(ev.logprob)
        self.top_logprobs.append({_piece(tokenizer, t)[0]: lp for t, lp in ev.top_logprobs})
        self.text_offset.append(offset)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        """The entries so far, cleared (one streaming chunk's worth)."""
        out = self.to_dict()
        self.__init__()
        return out


# --- chat ------------------------------------------------------------------------------------
def chat_chunk(job, model: str, delta: dict, reason: str | None = None, logprobs: list | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None,
              "finish_reason": reason}
    out = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model,
           "system_fingerprint": None, "choices": [choice]}
    if reason is not None:
        out.update(_extras(job))
    return out


def usage_chunk(job, model: str, obj: str) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [],
            "usage": usage(job)}


def chat_response(job, model: str, text: str, reason: str, logprobs: list | None) -> dict:
    return {
        "id": job.id, "object": "chat.completion", "created": job.created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": {"content": logprobs} if logprobs is not None else None,
                     "finish_reason": reason}],
        "usage": usage(job), **_extras(job),
    }


# --- completions -----------------------------------------------------------------------------
def completion_chunk(job, model: str, text: str, reason: str | None = None, logprobs: dict | None = None) -> dict:
    out = {"id": job.id, "object": "text_completion", "created": job.created, "model": model,
           "system_fingerprint": None,
           "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
    if reason is not None:
        out.update(_extras(job))
    return out


def completion_response(job, model: str, text: str, reason: str, logprobs: dict | None) -> dict:
    out = completion_chunk(job, model, text, reason, logprobs)
    out["usage"] = usage(job)
    return out
