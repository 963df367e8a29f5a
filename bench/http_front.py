"""The HTTP front vs the gRPC SDK on one server: tokens/s and peak server RSS (issue 32).

One ``megascore serve --model bench --http-port P`` (CPU, 127.0.0.1, stopped by PID)
serves both fronts, so the front is the only difference. The rollout length mix
(``common.make_workloads``, random ids below the vocabulary) is sent whole by each
variant, in requests of ``BATCH`` sequences, ``IN_FLIGHT`` in flight, from this
process:

* **grpc**: the SDK's ``AsyncScoringClient.score(seqs, top_k=1, losses=())``
  (logprobs and the top-1: what ``logprobs=1`` returns);
* **http-lp1**: ``POST /v1/completions`` with ``echo: true, logprobs: 1,
  max_tokens: 0, temperature: 0`` (lm-eval's loglikelihood shape);
* **http-pl20**: ``POST /v1/completions`` with ``prompt_logprobs: 20, max_tokens: 0``
  (vLLM's shape, 21 entries per position), reported beside them, not judged.

The HTTP client is aiohttp (lm-eval's), keep-alive connections, bodies encoded and
answers decoded with orjson, the actual tokens' logprobs read out of every answer as a
client would; tokens/s is measured from the first request sent to the last answer
read. The variants take turns in rounds (the order rotating per round); each figure is
the median over the rounds, and the ratios are the medians of the per-round ratios
(target: http-lp1 / grpc >= 0.8). The first round's logprobs of the HTTP variants are
checked against the gRPC ones (<= 1e-6; OpenAI's first position is null). The server's
peak RSS per variant is the sum over its processes of ``VmHWM``, reset through
``/proc/PID/clear_refs`` before every pass (a sampler would miss the answers' short
peaks); the server's CPU seconds per pass are reported beside (on a shared machine
they move less with the load than the wall clock).

Usage: ``python bench/http_front.py [--quick] [--sequences N] [--rounds R]`` writes
(or replaces) the section between the ``http_front.py`` markers of RESULTS.md
(``--output`` names another file; ``run_all.py`` keeps the section).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import common
import numpy as np
import orjson
from e2e_vs_engine import start_server

from megascore_server import procfs
from megascore_server.ports import pick_port
from megascore_server.serve_process import ServeProcess

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- http_front.py: begin -->", "<!-- http_front.py: end -->"
BATCH, IN_FLIGHT, MAX_TOKENS = 8, 4, 4096
TARGET, TOLERANCE, PROMPT_LOGPROBS = 0.8, 1e-6, 20
FLOOR = -9999.0  # the HTTP front sends logprobs below it as it (JSON has no -inf)
SHAPES = {  # the /v1/completions fields of each HTTP variant beside model and prompt
    "http-lp1": {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0},
    "http-pl20": {"prompt_logprobs": PROMPT_LOGPROBS, "max_tokens": 0, "temperature": 0},
}
VARIANTS = ("grpc", *SHAPES)


# ---- the server's processes ----------------------------------------------------------------


def reset_peaks(pids: list[int]) -> None:
    for pid in pids:
        procfs.reset_peak_rss(pid)  # VmHWM := the current RSS


def peak_mib(pids: list[int]) -> float:
    return sum(procfs.status_kib(pid, "VmHWM") for pid in pids) / 1024


def rss_mib(pids: list[int]) -> float:
    return sum(procfs.rss_kb(pid) for pid in pids) / 1024


# ---- the two fronts ------------------------------------------------------------------------


def lp1_logprobs(choice: dict, _ids: list[int]) -> np.ndarray:
    lps = choice["logprobs"]["token_logprobs"]
    if lps[0] is not None:
        raise RuntimeError(f"token_logprobs[0] is {lps[0]!r}, not null")
    return np.array(lps[1:], dtype=np.float64)


def pl20_logprobs(choice: dict, ids: list[int]) -> np.ndarray:
    rows = choice["prompt_logprobs"]
    if rows[0] is not None:
        raise RuntimeError(f"prompt_logprobs[0] is {rows[0]!r}, not null")
    return np.array([row[str(t)]["logprob"] for row, t in zip(rows[1:], ids[1:], strict=True)])


READ = {"http-lp1": lp1_logprobs, "http-pl20": pl20_logprobs}


class Fronts:
    """The SDK's async client and a keep-alive aiohttp session, both to ``server``."""

    def __init__(self, server: ServeProcess, grpc, http, url: str):
        self.server, self.grpc, self.http, self.url = server, grpc, http, url
        self.model = ""

    async def wait_http(self, timeout: float = 120.0) -> None:
        """Waits for ``/v1/models`` (the HTTP front starts beside gRPC); reads the model id."""
        import aiohttp

        deadline = time.monotonic() + timeout
        while True:
            try:
                async with self.http.get(f"{self.url}/v1/models") as resp:
                    if resp.status == 200:
                        self.model = orjson.loads(await resp.read())["data"][0]["id"]
                        return
            except aiohttp.ClientConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /v1/models answer:\n{self.server.output(3000)}")
            await asyncio.sleep(0.2)

    async def send(self, variant: str, seqs: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """One request; the logprobs of tokens 1.. of each sequence, and the answer's bytes
        (0 for gRPC)."""
        if variant == "grpc":
            res = await self.grpc.score(seqs, top_k=1, losses=())
            return [lp[1:] for lp in res.logprobs], 0
        body = orjson.dumps(
            {"model": self.model, "prompt": seqs, **SHAPES[variant]},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        headers = {"Content-Type": "application/json"}
        async with self.http.post(f"{self.url}/v1/completions", data=body, headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{variant}: HTTP {r.status}: {raw[:500]!r}")
        choices = orjson.loads(raw)["choices"]
        read = READ[variant]
        return [read(c, s.tolist()) for c, s in zip(choices, seqs, strict=True)], len(raw)


async def one_pass(fronts: Fronts, variant: str, requests: list[list[np.ndarray]]) -> dict:
    """The whole workload through one variant, ``IN_FLIGHT`` requests at a time."""
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(seqs):
        async with slots:
            return await fronts.send(variant, seqs)

    pids = fronts.server.tree()
    reset_peaks(pids)
    server_cpu, cpu = procfs.cpu_seconds(*pids), time.process_time()
    start = time.perf_counter()
    answers = await asyncio.gather(*(one(r) for r in requests))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "client_cpu_s": time.process_time() - cpu,
        "server_cpu_s": procfs.cpu_seconds(*pids) - server_cpu,
        "peak_mib": peak_mib(pids),
        "bytes": sum(n for _, n in answers),
        "logprobs": [lp for lps, _ in answers for lp in lps],
    }


def max_diff(ours: list[np.ndarray], grpc: list[np.ndarray]) -> float:
    return max(
        float(np.abs(a - np.maximum(b.astype(np.float64), FLOOR)).max(initial=0.0))
        for a, b in zip(ours, grpc, strict=True)
    )


async def measure_async(server: ServeProcess, http_port: int, num: int, rounds: int) -> dict:
    import aiohttp

    from megascore_client import AsyncScoringClient

    async with (
        AsyncScoringClient(server.target, timeout=3600.0) as grpc,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=IN_FLIGHT),
            timeout=aiohttp.ClientTimeout(total=3600.0),
        ) as http,
    ):
        fronts = Fronts(server, grpc, http, f"http://127.0.0.1:{http_port}")
        await fronts.wait_http()
        info = await fronts.grpc.model_info()
        workload, _ = common.make_workloads(
            num, 0, info.vocab_size, max_len=min(2048, info.max_sequence_length), num_uniform=0
        )
        seqs = workload.sequences
        requests = [seqs[i : i + BATCH] for i in range(0, len(seqs), BATCH)]
        warm = [common.warmup_sequences(workload)]
        for variant in VARIANTS:
            await one_pass(fronts, variant, warm)
        pids = server.tree()
        res: dict = {v: [] for v in VARIANTS}
        res |= {"model": fronts.model, "idle_mib": rss_mib(pids), "processes": len(pids)}
        res |= {"summary": workload.summary(), "tokens": workload.num_tokens}
        for rnd in range(rounds):
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            for variant in order:
                run = await one_pass(fronts, variant, requests)
                if rnd == 0:
                    res[f"lp_{variant}"] = run["logprobs"]
                del run["logprobs"]
                res[variant].append(run)
                print(
                    f"round {rnd + 1}/{rounds} {variant}: "
                    f"{workload.num_tokens / run['seconds']:.0f} tokens/s, server peak RSS "
                    f"{run['peak_mib']:.0f} MiB",
                    flush=True,
                )
    grpc_lps = res.pop("lp_grpc")
    res["diff"] = {v: max_diff(res.pop(f"lp_{v}"), grpc_lps) for v in SHAPES}
    return res


def measure(tmp: Path, num: int, rounds: int) -> dict:
    http_port = pick_port()
    server = start_server(
        "cpu", MAX_TOKENS, tmp / "server.log", extra_args=("--http-port", str(http_port))
    )
    try:
        server.wait_serving(900.0)
        res = asyncio.run(measure_async(server, http_port, num, rounds))
    finally:
        server.stop()
    res["load_end"] = common.load_average()
    return res


# ---- report --------------------------------------------------------------------------------


def figures(res: dict) -> dict[str, dict]:
    """Per variant: tokens/s (median, min, max), the per-round ratio to gRPC (median, min,
    max), the per-round median of gRPC's server CPU seconds over the variant's, server and
    client CPU seconds per pass, peak RSS (max over rounds), answer bytes per token."""
    med, tokens = statistics.median, res["tokens"]
    out = {}
    for variant in VARIANTS:
        runs = res[variant]
        tps = [tokens / r["seconds"] for r in runs]
        pairs = list(zip(res["grpc"], runs, strict=True))
        ratios = [g["seconds"] / r["seconds"] for g, r in pairs]
        by_cpu = [g["server_cpu_s"] / r["server_cpu_s"] for g, r in pairs]
        out[variant] = {
            "tps": (med(tps), min(tps), max(tps)),
            "ratio": (med(ratios), min(ratios), max(ratios)),
            "by_cpu": med(by_cpu),
            "server_cpu": med(r["server_cpu_s"] for r in runs),
            "client_cpu": med(r["client_cpu_s"] for r in runs),
            "peak": max(r["peak_mib"] for r in runs),
            "bytes_per_token": med(r["bytes"] for r in runs) / tokens,
        }
    return out


def verdict(res: dict) -> tuple[bool, str]:
    """``(whether the HTTP logprobs equal gRPC's, the verdict line)``."""
    ratio = figures(res)["http-lp1"]["ratio"][0]
    agree = all(d <= TOLERANCE for d in res["diff"].values())
    text = (
        f"http-lp1 / grpc tokens/s = {ratio:.2f} (target >= {TARGET}): "
        f"{'pass' if ratio >= TARGET else 'MISS'}; HTTP logprobs "
        + ("equal gRPC's" if agree else f"DIFFER from gRPC's (> {TOLERANCE:g})")
    )
    return agree, text


def section(res: dict, machine: dict, elapsed: float, command: str) -> str:
    fig = figures(res)
    rows = []
    for variant in VARIANTS:
        f = fig[variant]
        judged = variant == "http-lp1"
        result = ("pass" if f["ratio"][0] >= TARGET else "MISS") if judged else ""
        ratio, by_cpu, answer = "1", "1", "-"
        if variant != "grpc":
            ratio = f"{f['ratio'][0]:.2f} ({f['ratio'][1]:.2f}..{f['ratio'][2]:.2f})"
            by_cpu, answer = f"{f['by_cpu']:.2f}", f"{f['bytes_per_token']:.0f}"
        rows.append(
            f"| {variant} | {f['tps'][0]:.0f} ({f['tps'][1]:.0f}..{f['tps'][2]:.0f}) | {ratio} "
            f"| {f'>= {TARGET}' if judged else ''} | {result} | {f['server_cpu']:.2f} "
            f"| {by_cpu} | {f['client_cpu']:.2f} | {f['peak']:.0f} | {answer} |"
        )
    diffs = ", ".join(f"{v} {d:.1e}" for v, d in res["diff"].items())
    lines = [
        BEGIN,
        "## HTTP front vs gRPC SDK, one server (`bench/http_front.py`)",
        "",
        f"Written by `{command}` in {elapsed / 60:.1f} min ({machine['date']}, "
        f"{machine['cpu']}, {machine['torch']}, load average {machine['load average']} at "
        f"the start, {res['load_end']} at the end); rerun it to update this section.",
        "",
        f"* one `megascore serve --model bench --http-port P` (CPU, float32, "
        f"`--max-tokens-per-batch {MAX_TOKENS}`, model id `{res['model']}`, "
        f"{res['processes']} process(es), RSS {res['idle_mib']:.0f} MiB after the warm-up) "
        "serves both fronts",
        f"* workload `rollout`: {res['summary']}; requests of {BATCH} sequences, "
        f"{IN_FLIGHT} in flight, from one client process; the variants take turns, the "
        f"order rotating per round; {len(res['grpc'])} round(s)",
        "* grpc: `AsyncScoringClient.score(seqs, top_k=1, losses=())`; http-lp1: "
        "`/v1/completions` `echo: true, logprobs: 1, max_tokens: 0` (lm-eval's shape); "
        f"http-pl20: `prompt_logprobs: {PROMPT_LOGPROBS}, max_tokens: 0` (vLLM's); aiohttp "
        "keep-alive, orjson, each answer decoded and its logprobs read out",
        f"* HTTP logprobs vs gRPC's, first round, max abs diff: {diffs} (tolerance {TOLERANCE:g})",
        "",
        "| variant | tokens/s (median, rounds min..max) | / grpc (per-round median, min..max) "
        "| target | result | server CPU s per pass | / grpc by server CPU s "
        "| client CPU s per pass | server peak RSS MiB | answer bytes per token |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Server peak RSS: the sum over the server's processes of `VmHWM`, reset before "
        "every pass; the max over the rounds. By server CPU s: gRPC's server CPU seconds "
        "per pass over the variant's (per-round median), steadier than the wall clock on a "
        "loaded machine.",
        "",
        verdict(res)[1] + ".",
        END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="16 sequences, 2 rounds (a smoke run)")
    p.add_argument("--sequences", type=int, default=None, help="default 64 (16 with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (2 with --quick)")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    num = args.sequences or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 5)
    command = "python bench/http_front.py" + (" --quick" if args.quick else "")
    command += f" --sequences {num}" if args.sequences else ""
    command += f" --rounds {rounds}" if args.rounds else ""
    common.quiet_logs()
    results: dict = {}  # kept for the exit status: 1 when the fronts' logprobs differ
    common.run_own_section(
        "megascore-http-front-",
        (BEGIN, END),
        args.output,
        lambda tmp: results.setdefault("res", measure(tmp, num, rounds)),
        lambda res, machine, elapsed: section(res, machine, elapsed, command),
    )
    return 0 if verdict(results["res"])[0] else 1


if __name__ == "__main__":
    sys.exit(main())
