"""``megascore score``: score a JSONL file of token sequences (or texts) into a JSONL file.

Input rows are read and checked by :mod:`megascore_client.jsonl_rows` (``text`` rows
are tokenized by the server's tokenizer, or by ``--tokenizer DIR``:
:mod:`megascore_client.text_rows`). Ids must be unique. Output rows, in input order::

    {"id": ..., "num_tokens": L, "nll": sum,
     "token_ids": [...], "tokens": ["...", ...],         # only with --echo-tokens
     "logprobs": [...],                                  # then every output of the table
     "top_k_ids": [[...]], "top_k_logprobs": [[...]],   # only with --top-k
     "routing": [[[...]]],                               # only with --return-routing
     "losses": {"nll": sum}, "num_loss_tokens": n,
     "entropy": [...], ...}                              # each as its flag asks

After ``id``, ``num_tokens`` and ``nll`` (what the summary and a resumed run read), a row
holds every output of :data:`megascore.api.schema.OUTPUTS` the request got, under the
output's name, in the table's order: per token a list per position, per sequence the
row's value (a map output, e.g. ``mismatch`` for a row with ``rollout_logprobs``, as an
object). Every ``return_*`` option of the table that is not a batch metric is a flag
(``--return-entropy``, ``--return-token-ranks``, ...), and ``--logprob-positions`` takes
the enum's names: a new entry of the table reaches the CLI without an edit here.

``routing`` is, per token, per MoE layer of the decoder, the expert ids its router
chose (the replayed ones for a row that gave a ``routing``); fed back as the row's
``routing`` it is replayed (rows with and without one go in separate requests).

Bad rows (each checked where it is read, against the model's ``GetModelInfo``, and any
row the server refuses, traced back to its line) are named as ``FILE:LINE (id ...):
reason``. Without ``--skip-invalid`` the run stops at the first one with exit code 1,
after writing every row before it. With it, each bad row goes to ``OUT.rejected.jsonl``
(``{"line", "id", "reason"}``; rewritten by every run) and the run goes on.

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
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np

from megascore.api import schema
from megascore_client.errors import InvalidInputError, ScoringError
from megascore_client.jsonl_rows import BadRow, Row, RowLimits, key, read_rows
from megascore_client.text_rows import RowTokenizer, choose_tokenizer

__all__ = ["add_arguments", "load_done", "rejected_path", "run"]


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
    parser.add_argument(
        "--tokenizer",
        help="local tokenizer directory for rows with 'text' (default: the server's "
        "tokenizer when it has one, ModelInfo.has_tokenizer)",
    )
    parser.add_argument(
        "--echo-tokens",
        action="store_true",
        help="write each row's 'token_ids' and 'tokens' (the string of each id, by the "
        "tokenizer in use; token_ids only when there is none)",
    )
    parser.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_false",
        help="do not add BOS/EOS when tokenizing texts",
    )
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per batch")
    parser.add_argument("--concurrency", type=int, default=2, help="batches in flight")
    parser.add_argument("--top-k", type=int, default=0, help="top-k alternatives per token")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    _add_table_arguments(parser)
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
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="write bad rows to OUT.rejected.jsonl (line, id, reason) and go on, instead "
        "of stopping at the first one with exit code 1",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress line (rows, tokens/s) on stderr",
    )


def _add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per request option of the table a row can use (:func:`_row_options`)."""
    for option in _row_options():
        flag = "--" + option.name.replace("_", "-")
        if option.names is not None:
            parser.add_argument(
                flag,
                choices=list(option.names),
                default=next(iter(option.names)),
                help=f"the request's {option.name} option (default: %(default)s)",
            )
        else:
            what = option.name.removeprefix("return_")
            parser.add_argument(
                flag,
                action="store_true",
                help=f"write each row's {what} (the request's {option.name} option)",
            )


def rejected_path(output: Path) -> Path:
    """The side file of ``--skip-invalid``: ``out.jsonl`` -> ``out.rejected.jsonl``."""
    stem = output.name.removesuffix(".jsonl")
    return output.with_name(f"{stem}.rejected.jsonl")


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
                done[key(row["id"])] = (row["num_tokens"], row["num_loss_tokens"], row["nll"])
            except (ValueError, KeyError, TypeError):
                bad_line = number
                continue
            good_end += len(line)
        f.truncate(good_end)
    return done


class _Rejects:
    """Where bad rows go: the side file with ``--skip-invalid``; else they stop the run."""

    def __init__(self, path: Path | None):
        self.path = path
        self.count = 0
        self._file = None if path is None else path.open("w")

    def add(self, bad: BadRow) -> None:
        """Records ``bad`` in the side file, or raises it (no ``--skip-invalid``)."""
        if self._file is None:
            raise bad
        self._file.write(json.dumps(bad.record()) + "\n")
        self._file.flush()
        self.count += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _good_rows(items: Iterator[Row | BadRow], rejects: _Rejects) -> Iterator[Row]:
    for item in items:
        if isinstance(item, BadRow):
            rejects.add(item)
        else:
            yield item


def _batches(rows: Iterator[Row], batch_tokens: int, limit: int | None) -> Iterator[list[Row]]:
    """Cuts the rows into batches of about ``batch_tokens``; a bad row that stops the
    run (raised by ``rows``) first lets the rows before it through."""
    batch, tokens, count = [], 0, 0
    try:
        for row in rows:
            if limit is not None and count >= limit:
                break
            if batch and _inputs(row) != _inputs(batch[0]):
                yield batch  # a request carries a routing / rollout of all its rows or none
                batch, tokens = [], 0
            batch.append(row)
            tokens += len(row.token_ids)
            count += 1
            if tokens >= batch_tokens:
                yield batch
                batch, tokens = [], 0
    except BadRow:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


_ROW_INPUTS = ("routing", "rollout_logprobs", "target_ids")
"""The per-token inputs a row may carry (:mod:`megascore_client.jsonl_rows`), each an SDK
keyword of the same name."""


def _row_options() -> list[schema.Option]:
    """The options of the table the CLI spells as flags: every enum option and every
    ``return_*`` flag that asks for a row's output (not the batch's metrics, nor
    ``return_logprobs``, which is ``--no-logprobs``)."""
    return [
        o
        for o in schema.OPTIONS
        if o.names is not None
        or (o.name.startswith("return_") and o.default is False and not o.name.endswith("_metrics"))
    ]


def _inputs(row: Row) -> tuple:
    """Which optional per-token inputs a row carries (and the K of its target ids): rows
    that differ here go in separate requests."""
    shapes = [getattr(row, name) for name in _ROW_INPUTS]
    return tuple(None if a is None else a.shape[1:] for a in shapes)


def _json(values, dtype: str) -> str:
    """JSON of an array (nested lists) or a scalar; floats in their shortest round-trip
    form (float32 as float32)."""
    values = np.asarray(values)
    if values.ndim > 1:
        return "[" + ",".join(_json(v, dtype) for v in values) + "]"
    if values.dtype.kind != "f" or (values.size and not np.isfinite(values).all()):
        return json.dumps(values.tolist())
    text = values.astype(np.dtype(dtype)).astype(str).tolist()
    return text if values.ndim == 0 else "[" + ",".join(text) + "]"


def _outputs(result, i: int) -> list[str]:
    """``"name": value`` of row ``i`` for every output of the table ``result`` holds."""
    parts = []
    for out in schema.OUTPUTS:
        value = getattr(result, out.sdk, None)
        if value is None or (out.keys is not None and not value):
            continue
        if out.keys is not None:
            row = {k: v[i].item() for k, v in value.items()}
            parts.append(f'"{out.name}": {json.dumps(row)}')
        else:
            parts.append(f'"{out.name}": {_json(value[i], out.dtype)}')
    return parts


def _format_rows(batch: list[Row], scored, args) -> tuple[str, list[tuple[int, int, float]]]:
    result, tokens = scored
    lines, stats = [], []
    for i, row in enumerate(batch):
        n_loss, nll = int(result.num_tokens[i]), float(result.loss["nll"][i])
        parts = [
            f'"id": {json.dumps(row.id)}',
            f'"num_tokens": {len(row.token_ids)}',
            f'"nll": {json.dumps(nll)}',
        ]
        if args.echo_tokens:
            parts.append(f'"token_ids": {json.dumps(row.token_ids)}')
            if tokens is not None:
                parts.append(f'"tokens": {json.dumps(tokens[i], ensure_ascii=False)}')
        parts += _outputs(result, i)
        lines.append("{" + ", ".join(parts) + "}\n")
        stats.append((len(row.token_ids), n_loss, nll))
    return "".join(lines), stats


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def count_rows(path: Path) -> int:
    """The rows of an input file (its non-blank lines), read up front for the progress
    bar's total."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _progress(enabled: bool, total: int | None):
    """The progress bar on stderr: rows scored of ``total`` (the rows not yet in the
    output, at most ``--limit``), rows/s, tokens/s and the time left."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="row", desc="scoring", file=sys.stderr, dynamic_ncols=True)


def _refused_row(batch: list[Row], error: ScoringError, path: Path) -> tuple[int, BadRow]:
    """The row of ``batch`` that ``error`` (the failure of scoring it) names, as a bad
    row; ``error`` itself is raised when it names none (not the input's fault)."""
    index = error.sequence_index
    if error.code is not grpc.StatusCode.INVALID_ARGUMENT or index is None:
        raise error
    if not 0 <= index < len(batch):
        raise error
    row = batch[index]
    return index, BadRow(path, row.line, row.id, f"refused: {error.details}")


class _Output:
    """The output file and the running totals of the summary."""

    def __init__(self, file, done: dict, bar, args):
        self._file, self._bar, self._args = file, bar, args
        self._start = time.perf_counter()
        self.totals = [sum(v[i] for v in done.values()) for i in range(3)]
        self.rows = self.tokens = 0

    def write(self, batch: list[Row], result) -> None:
        """Appends the scored rows of ``batch`` (in order) and flushes."""
        if not batch:
            return
        text, stats = _format_rows(batch, result, self._args)
        self._file.write(text)
        self._file.flush()
        for i, value in enumerate(zip(*stats, strict=True)):
            self.totals[i] += sum(value)
        tokens = sum(s[0] for s in stats)
        self.rows += len(stats)
        self.tokens += tokens
        self._bar.update(len(stats))
        elapsed = time.perf_counter() - self._start
        self._bar.set_postfix_str(f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s", refresh=False)


def _scorer(client, args, tokenizer: RowTokenizer) -> Callable[[list[Row]], tuple]:
    """Scores a batch of rows with the CLI's options: ``(result, tokens)``, ``tokens``
    the token strings of each row with ``--echo-tokens`` and a tokenizer, else None."""

    def score(batch: list[Row]):
        has_mask = any(row.loss_mask is not None for row in batch)
        masks = [row.loss_mask or [1] * len(row.token_ids) for row in batch]
        inputs = {  # all rows or none (see _batches)
            name: [getattr(row, name) for row in batch]
            for name in _ROW_INPUTS
            if getattr(batch[0], name) is not None
        }
        result = client.score(
            [row.token_ids for row in batch],
            loss_mask=masks if has_mask else None,
            top_k=args.top_k,
            temperature=args.temperature,
            losses=("nll",),
            return_logprobs=args.logprobs,
            **inputs,
            **{o.name: getattr(args, o.name) for o in _row_options()},
        )
        echo = args.echo_tokens and tokenizer.available
        return result, tokenizer.token_strings([r.token_ids for r in batch]) if echo else None

    return score


def _write_settled(batch: list[Row], future, score, rejects: _Rejects, output: _Output, path):
    """Writes a batch's result. Rows the server refused are set aside and the rest of
    the batch scored again; without ``--skip-invalid`` the rows before the first
    refused one are written and it is raised (a :class:`BadRow`)."""
    try:
        output.write(batch, future.result())
        return
    except ScoringError as exc:
        error = exc
    stop = rejects.path is None
    while True:
        index, bad = _refused_row(batch, error, path)
        if not stop:
            rejects.add(bad)
        batch = batch[:index] + ([] if stop else batch[index + 1 :])
        try:
            output.write(batch, score(batch) if batch else None)
            break
        except ScoringError as exc:
            error = exc
    if stop:
        raise bad


def run(args, client) -> int:
    """Runs ``megascore score`` with a connected client; returns the exit code."""
    if args.batch_tokens < 1 or args.concurrency < 1:
        raise InvalidInputError("--batch-tokens and --concurrency must be >= 1")
    start = time.perf_counter()  # the summary's elapsed time includes any wait for the server
    done = load_done(args.output)
    info = client.model_info()
    limits = RowLimits.from_model_info(info)
    tokenizer = choose_tokenizer(args, client, info)
    if args.echo_tokens and not tokenizer.available:
        print(
            "megascore score: --echo-tokens: no tokenizer (the server has none and no "
            "--tokenizer DIR was given): rows carry token_ids only",
            file=sys.stderr,
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    rejects = _Rejects(rejected_path(args.output) if args.skip_invalid else None)
    todo = max(count_rows(args.input) - len(done), 0)
    bar = _progress(args.progress, todo if args.limit is None else min(todo, args.limit))
    score = _scorer(client, args, tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrency)
    inflight: collections.deque = collections.deque()
    try:
        with args.output.open("a") as out:
            output = _Output(out, done, bar, args)
            rows = read_rows(
                args.input,
                limits,
                skip=done.__contains__,
                tokenize=tokenizer.encode if tokenizer.available else None,
            )
            batches = _batches(_good_rows(rows, rejects), args.batch_tokens, args.limit)
            stop = None  # a bad row read: the rows before it are scored first
            while True:
                try:
                    batch = next(batches, None)
                except BadRow as bad:
                    stop, batch = bad, None
                if batch is None:
                    break
                if len(inflight) >= args.concurrency:
                    _write_settled(*inflight.popleft(), score, rejects, output, args.input)
                inflight.append((batch, pool.submit(score, batch)))
            while inflight:
                _write_settled(*inflight.popleft(), score, rejects, output, args.input)
            if stop is not None:
                raise stop
    except BadRow as bad:
        raise InvalidInputError(str(bad)) from None
    finally:
        for _, future in inflight:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)  # the client closes what still runs
        bar.close()
        rejects.close()
    _summary(output, len(done), rejects, time.perf_counter() - start)
    return 0


def _summary(output: _Output, skipped: int, rejects: _Rejects, elapsed: float) -> None:
    tokens, loss_tokens, nll = output.totals
    mean_nll = nll / loss_tokens if loss_tokens else float("nan")
    print(f"rows: {skipped + output.rows} (scored {output.rows}, skipped {skipped} already done)")
    if rejects.path is not None:
        print(f"rejected: {rejects.count} (listed in {rejects.path})")
    print(f"tokens: {tokens} ({loss_tokens} predicted)")
    print(f"mean NLL per token: {mean_nll:.6f}")
    perplexity = math.exp(min(mean_nll, 709.0)) if loss_tokens else float("nan")
    print(f"perplexity: {perplexity:.4f}")
    rate = output.tokens / elapsed if elapsed > 0 else 0.0
    print(f"elapsed: {elapsed:.2f} s ({rate:.0f} tokens/s)")
