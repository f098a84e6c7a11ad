"""`dflash2-decode serve`: an OpenAI-compatible server that batches speculative requests.

    engine.py    the ONE engine thread: models, every request's state, the scheduler
    app.py       Starlette routes (parse, submit, relay events as JSON / SSE)
    protocol.py  request fields -> GenRequest, typed errors -> OpenAI error bodies
    stops.py     stop strings across step boundaries (hold-back)
    logprobs.py  per-token logprob entries in OpenAI's completions / chat shapes
    reasoning.py think tags / harmony channels -> reasoning_content vs content
    limits.py    body size (413), JSON depth (400), long texts tokenised in a worker process, path scrubbing
    metrics.py   Prometheus text
    server.py    uvicorn on a bound socket, SIGTERM draining
    command.py   the click command

Needs the optional extra: pip install "dflash2-numba[serve]" (starlette, uvicorn).
"""
