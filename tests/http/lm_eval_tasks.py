"""Two local lm-eval tasks (task YAML + jsonl data in a folder, no hub): a multiple-choice
task (``loglikelihood`` requests, ``acc``) and a ``loglikelihood_rolling`` task, and a runner
that evaluates a model on them and returns the per-document results of ``log_samples``."""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK = "megascore_http_mc"
ROLLING_TASK = "megascore_http_rolling"

MC_DOCS = [
    {
        "question": "Question: who eats an apple at home?\nAnswer:",
        "choices": [" the cat", " a dog", " the violin"],
        "answer": 0,
    },  # noqa: E501
    {
        "question": "Question: what does the teacher read?\nAnswer:",
        "choices": [" the paper", " some bread", " a small boat", " the river"],
        "answer": 0,
    },  # noqa: E501
    {
        "question": "Question: where does the old man paint?\nAnswer:",
        "choices": [" in the garden", " during winter"],
        "answer": 1,
    },  # noqa: E501
    {
        "question": "Question: my friend builds\nAnswer:",
        "choices": [" a red house", " two boxes", " several strange letters"],
        "answer": 2,
    },  # noqa: E501
    {
        "question": "Question: how many legs has a cat?\nAnswer:",
        "choices": [" four", " two", " 1234"],
        "answer": 0,
    },  # noqa: E501
    {
        "question": "Question: what colour is the sky?\nAnswer:",
        "choices": [" blue", " yellow", " red"],
        "answer": 0,
    },  # noqa: E501
]
"""Six questions, 2-4 choices each (continuations of one to several tokens)."""

ROLLING_DOCS = [
    "the cat eats an apple at home.",
    "every student remembers the yellow lamp beyond the mountains, and the farmer sells bread.",
    "The quick brown fox jumps over the lazy dog.",
    "a young pilot questions several strange letters inside the kitchen before breakfast.",
    "Numbers like 42 and 7 appear in text; so do symbols: #, % and @!",
    "her brother forgets a heavy wooden chair near the river on monday.",
]
"""Six documents for ``loglikelihood_rolling`` (each fits one window)."""


def greedy_doc(reference) -> dict:
    """A question whose choices are the model's greedy next token, its greedy two-token
    continuation and an unlikely word, so that ``is_greedy`` is true for some choices
    (``reference``: a :class:`tests.http.checkpoint.Reference`). The question is the first
    corpus sentence whose greedy tokens encode back to themselves after it (lm-eval splits
    the joined encoding; a lone byte of a UTF-8 character would not)."""
    from tests.http.checkpoint import CORPUS

    for sentence in CORPUS:
        question = sentence.rstrip(".")
        ids = reference.encode(question)
        first = int(reference.logprobs(ids)[-1].argmax())
        second = int(reference.logprobs([*ids, first])[-1].argmax())
        choices = [reference.tokenizer.decode(c) for c in ([first], [first, second])]
        if all(
            reference.encode(question + c) == [*ids, *t]
            for c, t in zip(choices, ([first], [first, second]), strict=True)
        ):  # noqa: E501
            return {"question": question, "choices": [*choices, " violin"], "answer": 0}
    raise AssertionError("no corpus sentence has a greedy continuation that encodes back")


def write_tasks(folder: Path, extra_mc_docs=()) -> Path:
    """Writes the two task YAMLs and their jsonl data (:data:`MC_DOCS` and
    ``extra_mc_docs``, :data:`ROLLING_DOCS`) to ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "datasets-cache"
    mc_docs = [*MC_DOCS, *extra_mc_docs]
    for name, docs in ((MC_TASK, mc_docs), (ROLLING_TASK, [{"text": t} for t in ROLLING_DOCS])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  cache_dir: {json.dumps(str(cache))}\n"
        "  data_files:\n"
        "    test: {data}\n"
        "test_split: test\n"
    )
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n"
        + common.format(data=json.dumps(str(folder / f"{MC_TASK}.jsonl")))
        + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n"
        "  - metric: acc\n"
    )
    (folder / f"{ROLLING_TASK}.yaml").write_text(
        f"task: {ROLLING_TASK}\n"
        + common.format(data=json.dumps(str(folder / f"{ROLLING_TASK}.jsonl")))
        + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\n"
        "doc_to_target: '{{text}}'\n"
        "metric_list:\n"
        "  - metric: word_perplexity\n"
        "  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    return folder


def evaluate(folder: Path, model: str, model_args: str, batch_size: int = 1) -> dict:
    """``lm_eval.simple_evaluate`` of ``model`` on both tasks of ``folder``; returns
    ``{task: {"acc": ..., "docs": {doc_id: [resps of each request]}}}`` where a response
    is ``[loglikelihood, is_greedy]`` (multiple choice) or ``loglikelihood`` (rolling)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[MC_TASK, ROLLING_TASK],
        task_manager=manager,
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
    )
    results = {}
    for task in (MC_TASK, ROLLING_TASK):
        docs = {}
        for sample in out["samples"][task]:
            docs[sample["doc_id"]] = [_plain(r[0]) for r in sample["resps"]]
        results[task] = {"metrics": out["results"][task], "docs": docs}
    return results


def _plain(resp):
    """A response as JSON-like values (lm-eval keeps tuples of floats / bools)."""
    if isinstance(resp, (tuple, list)):
        return [float(resp[0]), bool(resp[1])]
    return float(resp)
