"""The contract every side shares: torch-free, numpy only.

What a request may ask and an answer holds (``schema``: the table of options, inputs and
outputs; ``types``: the domain request and result), the numpy token-layout arithmetic
(``layout``), cutting and joining results by sequence (``selection``), the rollout
mismatch statistics (``mismatch``), prompts sent once (``prompt_groups``), the array
codec of the wire (``wire``) and the errors (``errors``). The generated stubs live in
``megascore.v1`` (the proto package names their import path). The client, both fronts
and the engine import this package; it imports nothing of theirs.
"""
