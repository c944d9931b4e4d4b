"""The OpenAI-compatible HTTP server (``python -m bloomery_jax.serve``).

Modules, one job each:

* ``provider``: loads the model, tokenizer and chat template, owns the engine's scheduler and
  the worker thread that steps it; the only thing the handlers talk to;
* ``jobs``: one submitted request as the handlers see it (events on an asyncio queue);
* ``prompts``: chat messages / completion prompts → token ids, sampling and stop settings;
* ``schemas``: request bodies (pydantic, strict types, OpenAI's ranges);
* ``errors``: OpenAI's error JSON and the exception the handlers raise;
* ``formats``: response objects, SSE chunks, logprobs, timings;
* ``metrics``: counters and Prometheus text;
* ``app``: the FastAPI handlers and the Bearer-key check;
* ``cli``: command-line options and uvicorn.
"""
