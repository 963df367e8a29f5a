"""Tiny transformers-saved checkpoints with their own tokenizer, for the HTTP client tests.

The tokenizer is a byte-level BPE trained here, offline, with the ``tokenizers`` library on
:data:`CORPUS` and saved as ``tokenizer.json`` + ``tokenizer_config.json`` (what
``AutoTokenizer.from_pretrained(DIR)`` loads, and what the server's ``hf:DIR`` default
tokenizer is). The models are the checkpoint tests' tiny random families
(:mod:`testkit.checkpoints`, rescaled weights so that logprobs spread over
several nats) with the vocabulary of that tokenizer. :class:`Reference` scores token ids
with ``transformers`` loaded back from the directory: the independent side of every test.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
VOCAB = 512
"""Tokenizer and model vocabulary (the BPE trainer fills it; :func:`train_tokenizer` checks)."""

_SUBJECTS = (
    "the cat",
    "a dog",
    "my friend",
    "the teacher",
    "our neighbour",
    "the old man",
    "every student",
    "her brother",
    "a young pilot",
    "the quiet farmer",
)
_VERBS = (
    "eats",
    "reads",
    "paints",
    "finds",
    "carries",
    "watches",
    "builds",
    "sells",
    "forgets",
    "remembers",
    "explains",
    "questions",
)
_OBJECTS = (
    "an apple",
    "the paper",
    "a red house",
    "some bread",
    "two boxes",
    "a small boat",
    "the yellow lamp",
    "several strange letters",
    "a heavy wooden chair",
    "the violin",
)
_PLACES = (
    "at home",
    "in the garden",
    "near the river",
    "on monday",
    "after school",
    "today",
    "during winter",
    "beyond the mountains",
    "inside the kitchen",
    "before breakfast",
)

CORPUS = [
    f"{s} {v} {o} {p}."
    for i, (s, v, o, p) in enumerate(
        (s, v, o, p) for s in _SUBJECTS for v in _VERBS for o in _OBJECTS for p in _PLACES
    )
    if i % 7 == 0
] + [
    "Question: what colour is the sky? Answer: blue.",
    "Question: how many legs has a cat? Answer: four.",
    "The quick brown fox jumps over the lazy dog, 1234567890 times!",
    "Numbers like 42, 7 and 1000 appear in text; so do symbols: #, %, & and @.",
]
"""Training text of the tokenizer (~700 sentences, ASCII)."""


def train_tokenizer(directory: Path):
    """Trains the byte-level BPE on :data:`CORPUS` and saves it (``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``) to ``directory``; returns the
    ``transformers`` tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    # No post-processor: encoding adds no BOS / EOS, so lm-eval's hf model (which encodes with
    # add_special_tokens=True) and its API models (False) produce the same ids.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, model_max_length=512)
    fast.save_pretrained(directory)
    return fast


def write_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny ``family`` model (``llama``, ``qwen3_moe``, ...) with the trained tokenizer's
    vocabulary, saved with ``save_pretrained`` (float32) to ``directory`` with the tokenizer."""
    import torch
    import transformers

    from testkit.checkpoints import _named_tensors, _rescale, hf_config

    directory = Path(directory)
    tokenizer = train_tokenizer(directory)
    config = hf_config(family)
    config.vocab_size = VOCAB
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    config.pad_token_id = None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _rescale(_named_tensors(model), torch.Generator().manual_seed(seed))
    model.to(torch.float32).save_pretrained(directory)
    return directory


class Reference:
    """``transformers`` on a saved checkpoint (loaded back from disk, float32, CPU)."""

    def __init__(self, directory: Path):
        import torch
        import transformers

        self.directory = Path(directory)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32
        ).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one Reference per session
    def _logprobs(self, ids: tuple[int, ...]) -> np.ndarray:
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1).numpy()

    def logprobs(self, ids) -> np.ndarray:
        """float64 ``[L, V]``: row t is log p(. | ids[:t+1]) (row L-1 predicts after the end)."""
        return self._logprobs(tuple(int(i) for i in ids))

    def token_logprobs(self, ids) -> np.ndarray:
        """float64 ``[L - 1]``: log p(ids[t] | ids[:t]) for t = 1 .. L-1."""
        lp = self.logprobs(ids)
        return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids


def check_top(got: dict[int, float], row: np.ndarray, k: int, tol: float) -> float:
    """Checks a returned top-k ``{id: logprob}`` against the reference row ``[V]``: every
    returned logprob equals the reference at its id and the returned values are the k
    largest of the row (ties within ``tol`` may pick either id). Returns the max |delta|."""
    assert len(got) == k, (len(got), k)
    ids = np.fromiter(got, dtype=np.int64)
    values = np.fromiter(got.values(), dtype=np.float64)
    delta = float(np.max(np.abs(row[ids] - values)))
    expected = np.sort(row)[::-1][:k]
    delta = max(delta, float(np.max(np.abs(np.sort(values)[::-1] - expected))))
    assert delta <= tol, (got, dict(enumerate(expected)))
    return delta
