"""What the tests share with the benches and scripts (not shipped): tiny random
checkpoints and their reference logprobs (``checkpoints``), the reference scoring of the
tiny model (``reference``), hostile requests (``hostile``) and mixed client load
(``load``). ``tests/``, ``bench/`` and ``scripts/`` import it; it imports only the
products."""
