"""lm-evaluation-harness as a test client (issue 10): its ``local-completions`` backend against a
real server must agree with its own ``hf`` backend on the same checkpoint, per example:
loglikelihoods (multiple choice, rolling) within 1e-4 and the same greedy flags, and equal
generate_until outputs, at TP 1 and TP 2.

The tasks are in ``lm_eval_tasks/`` (a JSON-lines file read by the datasets ``json`` loader);
docs/api.md gives the same run as a command line against any deployment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_server import REPO, start_server

lm_eval = pytest.importorskip("lm_eval")

TASKS = ["shardline_tiny_mc", "shardline_tiny_rolling", "shardline_tiny_gen"]
TASK_DIR = Path(__file__).parent / "lm_eval_tasks"


def _evaluate(model: str, model_args: dict) -> dict[str, list]:
    """Per task, the filtered responses of each request, in the harness's own order."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, log_samples=True,
                                  task_manager=TaskManager(include_path=str(TASK_DIR)), device="cpu")
    return {task: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in out["samples"].items()}


def _assert_agree(api: dict[str, list], hf: dict[str, list]) -> None:
    assert set(api) == set(hf) == set(TASKS)
    for task in ("shardline_tiny_mc", "shardline_tiny_rolling"):
        assert len(api[task]) == len(hf[task]) == 4
        for got, want in zip(api[task], hf[task]):
            got_lls = [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in got]
            want_lls = [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in want]
            assert got_lls == pytest.approx(want_lls, abs=1e-4), task
            assert [str(r[1]) for r in got if isinstance(r, (list, tuple))] == \
                   [str(r[1]) for r in want if isinstance(r, (list, tuple))], task
            assert all(v < 0 for v in got_lls)  # a real score, not the 0.0 of an ignored prompt
    assert len(api["shardline_tiny_gen"]) == 4
    for got in api["shardline_tiny_gen"]:  # two empty answers (errors, ignored prompts) would agree too
        assert any(str(text).strip() for text in got), api["shardline_tiny_gen"]
    assert api["shardline_tiny_gen"] == hf["shardline_tiny_gen"]


@pytest.fixture(scope="module")
def hf_reference(serving_checkpoint, monkeypatch_module):
    return _evaluate("hf", {"pretrained": str(serving_checkpoint), "dtype": "float32"})


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.chdir(REPO)  # the task YAMLs name their data file relative to the repository root
    yield mp
    mp.undo()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_local_completions_agrees_with_hf(tp, request, serving_checkpoint, checkpoint_dir, hf_reference):
    # TP 1: the session's shared server; TP 2: two scheduler ranks over gloo on this machine.
    srv = request.getfixturevalue("server") if tp == 1 else start_server(
        serving_checkpoint, checkpoint_dir, "--tp-size", "2", "--max-total-tokens", "2048", "--served-model-name", "tiny-llama")
    try:
        api = _evaluate("local-completions", {
            "model": "tiny-llama", "base_url": srv.url + "/v1/completions", "tokenizer": str(serving_checkpoint),
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
        })
    finally:
        if tp != 1:
            srv.stop()
    _assert_agree(api, hf_reference)
