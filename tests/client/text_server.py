"""A fake Scorer with a tokenizer: ``Tokenize`` / ``Detokenize`` answered by a real
``tokenizers`` WordLevel tokenizer over ``t0`` .. ``t511`` (a BOS ``t1`` added as its
post-processor does), so tests compare the client with that tokenizer called directly.
"""

from __future__ import annotations

import grpc
import numpy as np

from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from tests.client.fake_server import INT_DTYPES, VOCAB, FakeScorer

BOS = 1


def word_tokenizer():
    """The WordLevel tokenizer: ``"t5 t9"`` -> ``[5, 9]`` (``[1, 5, 9]`` with specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", BOS)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["t1"])
    return tok


class TextScorer(FakeScorer):
    """:class:`FakeScorer` plus a tokenizer (``has_tokenizer`` None = none: the text RPCs
    answer FAILED_PRECONDITION as the real server does)."""

    def __init__(self, *, has_tokenizer: bool = True, **kw):
        super().__init__(**kw)
        self.tokenizer = word_tokenizer() if has_tokenizer else None

    def GetModelInfo(self, request, context):
        info = super().GetModelInfo(request, context)
        info.has_tokenizer = self.tokenizer is not None
        return info

    def _need_tokenizer(self, context):
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the server has no tokenizer")

    def Tokenize(self, request, context):
        self._enter("Tokenize", context)
        self._need_tokenizer(context)
        ids = [
            self.tokenizer.encode(t, add_special_tokens=request.add_special_tokens).ids
            for t in request.texts
        ]
        flat = np.asarray([i for row in ids for i in row], dtype=np.int64)
        return pb.TokenizeResponse(
            token_ids=encode_array(flat),
            lengths=encode_array(np.asarray([len(r) for r in ids], dtype=np.int64)),
        )

    def Detokenize(self, request, context):
        self._enter("Detokenize", context)
        self._need_tokenizer(context)
        ids = decode_array(request.token_ids, "token_ids", INT_DTYPES).astype(np.int64)
        lengths = decode_array(request.lengths, "lengths", INT_DTYPES).astype(np.int64)
        rows = np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else []
        skip = request.skip_special_tokens
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=skip) for r in rows]
        tokens = [self.tokenizer.id_to_token(int(i)) for i in ids]
        return pb.DetokenizeResponse(texts=texts, tokens=tokens)
