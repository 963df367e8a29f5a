"""``megascore score``: score a JSONL file of token sequences (or texts) into a JSONL file.

Input rows (one JSON value per line; blank lines are ignored):

* ``{"id": ..., "token_ids": [...], "loss_mask": [...]}`` (``id`` and ``loss_mask``
  optional);
* a bare list of token ids;
* ``{"id": ..., "text": "..."}`` with ``--tokenizer DIR`` (a local Hugging Face
  tokenizer directory: ``transformers.AutoTokenizer`` when installed, else
  ``tokenizers`` with ``DIR/tokenizer.json``).

A row without ``id`` is identified by its index among the non-blank input lines.
Ids must be unique. Output rows, in input order::

    {"id": ..., "num_tokens": L, "num_loss_tokens": n, "nll": sum, "logprobs": [...],
     "top_k_ids": [[...]], "top_k_logprobs": [[...]]}   # top-k only with --top-k

The run is resumable: rows whose id is already in the output are skipped and new
rows are appended; a truncated last line (an interrupted write) is dropped first.
The summary (rows, tokens, mean NLL per token, perplexity) covers the whole output.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megascore_client.errors import InvalidInputError


def _seconds(text: str) -> float:
    """argparse type of ``--wait-for-server``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``score`` subcommand's own arguments."""
    parser.add_argument("input", type=Path, help="input JSONL file")
    parser.add_argument("-o", "--output", type=Path, required=True, help="output JSONL file")
    parser.add_argument("--tokenizer", help="local tokenizer directory for rows with 'text'")
    parser.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_false",
        help="do not add BOS/EOS when tokenizing texts",
    )
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per batch")
    parser.add_argument("--concurrency", type=int, default=2, help="batches in flight")
    parser.add_argument("--top-k", type=int, default=0, help="top-k alternatives per token")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--no-logprobs", dest="logprobs", action="store_false", help="omit per-token logprobs"
    )
    parser.add_argument("--limit", type=int, default=None, help="score at most N new rows")
    parser.add_argument(
        "--wait-for-server",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="ride out a server that is down or restarting for up to S seconds: a request "
        "still UNAVAILABLE after gRPC's retries is re-sent until the server answers "
        "(the client's wait_for_server_s; --timeout must exceed S, default 60 + S)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def _key(row_id) -> str:
    return json.dumps(row_id, sort_keys=True)


def load_done(path: Path) -> dict[str, tuple[int, int, float]]:
    """Reads an existing output file for resuming; drops a truncated last line.

    Returns:
        id key -> (num_tokens, num_loss_tokens, nll) of every complete row.

    Raises:
        ValueError: a line other than the last is not valid JSON.
    """
    done: dict[str, tuple[int, int, float]] = {}
    if not path.exists():
        return done
    good_end = 0
    with path.open("rb+") as f:
        bad_line = None
        for number, line in enumerate(f, 1):
            if bad_line is not None:
                raise ValueError(f"{path}:{bad_line}: corrupt line in the middle of the file")
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                row = json.loads(line)
                done[_key(row["id"])] = (row["num_tokens"], row["num_loss_tokens"], row["nll"])
            except (ValueError, KeyError, TypeError):
                bad_line = number
                continue
            good_end += len(line)
        f.truncate(good_end)
    return done


def _load_tokenizer(path: str, add_special_tokens: bool):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None  # noqa: N806
    if AutoTokenizer is not None:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return lambda text: tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("--tokenizer needs 'transformers' or 'tokenizers' installed") from None
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=add_special_tokens).ids


def read_rows(args, done: dict) -> Iterator[tuple[object, list[int], list[int] | None]]:
    """Yields (id, token_ids, loss_mask) of the input rows not in ``done``."""
    tokenize = None
    seen: set[str] = set()
    index = -1
    with args.input.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            index += 1
            where = f"{args.input}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise InvalidInputError(f"{where}: invalid JSON ({exc})") from None
            mask = None
            if isinstance(row, list):
                row_id, ids = index, row
            elif isinstance(row, dict):
                row_id, mask = row.get("id", index), row.get("loss_mask")
                if "token_ids" in row:
                    ids = row["token_ids"]
                elif "text" in row:
                    if not args.tokenizer:
                        raise InvalidInputError(f"{where}: a 'text' row needs --tokenizer DIR")
                    if tokenize is None:
                        tokenize = _load_tokenizer(args.tokenizer, args.add_special_tokens)
                    ids = list(tokenize(row["text"]))
                else:
                    raise InvalidInputError(f"{where}: row needs 'token_ids' or 'text'")
            else:
                raise InvalidInputError(f"{where}: expected an object or a list of token ids")
            key = _key(row_id)
            if key in seen:
                raise InvalidInputError(f"{where}: duplicate id {row_id!r}")
            seen.add(key)
            if key in done:
                continue
            if not ids:
                raise InvalidInputError(f"{where}: empty token sequence")
            yield row_id, ids, mask


def _batches(rows: Iterator, batch_tokens: int, limit: int | None) -> Iterator[list]:
    batch, tokens, count = [], 0, 0
    for row in rows:
        if limit is not None and count >= limit:
            break
        batch.append(row)
        tokens += len(row[1])
        count += 1
        if tokens >= batch_tokens:
            yield batch
            batch, tokens = [], 0
    if batch:
        yield batch


def _floats(values: np.ndarray) -> str:
    """JSON list of float32 values in their shortest round-trip form."""
    if values.size and not np.isfinite(values).all():
        return json.dumps(values.tolist())
    return "[" + ",".join(values.astype(str).ravel().tolist()) + "]"


def _format_rows(batch: list, result, args) -> tuple[str, list[tuple[int, int, float]]]:
    lines, stats = [], []
    for i, (row_id, ids, _) in enumerate(batch):
        n_loss, nll = int(result.num_tokens[i]), float(result.loss["nll"][i])
        parts = [
            f'"id": {json.dumps(row_id)}',
            f'"num_tokens": {len(ids)}',
            f'"num_loss_tokens": {n_loss}',
            f'"nll": {json.dumps(nll)}',
        ]
        if result.logprobs is not None:
            parts.append(f'"logprobs": {_floats(result.logprobs[i])}')
        if result.top_k:
            rows_ids = ",".join(json.dumps(r) for r in result.top_k_ids[i].tolist())
            rows_lps = ",".join(_floats(r) for r in result.top_k_logprobs[i])
            parts.append(f'"top_k_ids": [{rows_ids}]')
            parts.append(f'"top_k_logprobs": [{rows_lps}]')
        lines.append("{" + ", ".join(parts) + "}\n")
        stats.append((len(ids), n_loss, nll))
    return "".join(lines), stats


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(unit="tok", unit_scale=True, desc="scoring", file=sys.stderr, dynamic_ncols=True)


def run(args, client) -> int:
    """Runs ``megascore score`` with a connected client; returns the exit code."""
    if args.batch_tokens < 1 or args.concurrency < 1:
        raise InvalidInputError("--batch-tokens and --concurrency must be >= 1")
    done = load_done(args.output)
    skipped = len(done)
    totals = [sum(v[i] for v in done.values()) for i in range(3)]
    scored_rows = scored_tokens = 0
    start = time.perf_counter()
    bar = _progress(args.progress)

    def score(batch):
        masks = [m if m is not None else [1] * len(ids) for _, ids, m in batch]
        has_mask = any(m is not None for _, _, m in batch)
        return client.score(
            [ids for _, ids, _ in batch],
            loss_mask=masks if has_mask else None,
            top_k=args.top_k,
            temperature=args.temperature,
            losses=("nll",),
            return_logprobs=args.logprobs,
        )

    args.output.parent.mkdir(parents=True, exist_ok=True)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrency)
    inflight: collections.deque = collections.deque()
    try:
        with args.output.open("a") as out:

            def write_oldest():
                nonlocal scored_rows, scored_tokens
                batch, future = inflight.popleft()
                text, stats = _format_rows(batch, future.result(), args)
                out.write(text)
                out.flush()
                for i, value in enumerate(zip(*stats, strict=True)):
                    totals[i] += sum(value)
                tokens = sum(s[0] for s in stats)
                scored_rows += len(stats)
                scored_tokens += tokens
                bar.update(tokens)
                bar.set_postfix(rows=scored_rows)

            for batch in _batches(read_rows(args, done), args.batch_tokens, args.limit):
                if len(inflight) >= args.concurrency:
                    write_oldest()
                inflight.append((batch, pool.submit(score, batch)))
            while inflight:
                write_oldest()
    finally:
        for _, future in inflight:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)  # the client closes what still runs
        bar.close()
    elapsed = time.perf_counter() - start
    tokens, loss_tokens, nll = totals
    mean_nll = nll / loss_tokens if loss_tokens else float("nan")
    print(f"rows: {skipped + scored_rows} (scored {scored_rows}, skipped {skipped} already done)")
    print(f"tokens: {tokens} ({loss_tokens} predicted)")
    print(f"mean NLL per token: {mean_nll:.6f}")
    perplexity = math.exp(min(mean_nll, 709.0)) if loss_tokens else float("nan")
    print(f"perplexity: {perplexity:.4f}")
    rate = scored_tokens / elapsed if elapsed > 0 else 0.0
    print(f"elapsed: {elapsed:.2f} s ({rate:.0f} tokens/s)")
    return 0
