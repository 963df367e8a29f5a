"""The HTTP front: OpenAI/vLLM ``/v1/completions`` and SGLang ``/generate`` over the
scoring service (docs/http.md).

``server`` binds and runs it (uvicorn, in rank 0's event loop beside gRPC); ``app``
assembles the routes and the guarantees every route shares (token, limits,
deadlines, metrics, errors in OpenAI's shape); ``completions`` and ``generate`` are
the two dialects, ``extras`` the ``megascore`` key that reaches every option and
output of the table, ``tokens`` the tokenizer routes and token strings.
"""
