"""The tests docs/api.md and docs/operations.md name beside their behavioural claims exist.

A claim names its test as ``tests/<dir>/<file>.py::<test>``, ``<file>.py::<test>`` (a file under
tests/) or ``::<test>`` (the file named last before it); a ``*`` ends a prefix of test names.
Each must resolve to a test function defined in that file, so a renamed or deleted test cannot
leave a claim pointing at nothing. CLAIMS lists the claims issue 27 found untested, each with the
text that must stay in the docs and its test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/api.md", "docs/operations.md")
REFERENCE = re.compile(r"`((?:[\w./-]+\.py)?)::(test_\w+\*?)`")

CLAIMS = [
    ("docs/api.md", "`num_held_reqs`", "test_weight_update_hold.py::test_held_requests_are_counted_in_server_info"),
    ("docs/api.md", "once its queued and running requests have finished",
     "test_lora_serving.py::test_unload_answers_once_the_adapters_running_requests_finished"),
    ("docs/api.md", "Without `--enable-lora` both endpoints answer 400 naming the flag",
     "test_documented_behaviour.py::test_adapter_endpoints_without_enable_lora_are_400_naming_the_flag"),
    ("docs/api.md", "With LoRA enabled the prefix cache is off",
     "test_lora_serving.py::test_prefix_cache_is_off_with_lora"),
    ("docs/api.md", "Decode\n  CUDA graphs are captured with LoRA",
     "test_lora_runner.py::test_lora_graph_static_path_gives_the_eager_greedy_tokens"),
    ("docs/api.md", "`cuda_graphs` (the same as `weights.graphs`",
     "test_documented_behaviour.py::test_server_info_reports_that_a_cpu_server_captured_no_graphs"),
    ("docs/api.md", "so captured graphs stay valid",
     "test_weight_sync_runner.py::test_torch_memory_saver_keeps_addresses_and_frees_the_gpu"),
    ("docs/api.md", "decode graphs are captured again at resume",
     "test_weight_sync_runner.py::test_without_memory_saver_decode_graphs_are_captured_again_at_resume"),
    ("docs/operations.md", "finalizer (`shardline.dev/finalizer`)",
     "test_cluster_events.py::test_pod_events_drive_status_and_metrics"),
    ("docs/operations.md", "not on a group that is updating weights",
     "test_lora_adapters.py::test_adapters_are_not_synced_to_a_group_updating_weights"),
    ("docs/operations.md", "a canary rollout with\n`spec.auth` passes its gate",
     "test_operator_calls_with_keys.py::test_canary_gate_passes_with_the_api_key"),
    ("docs/api.md", "a trainer written for SGLang",
     "test_weight_sync_sglang_trainer.py::test_sglang_style_trainer_updates_the_weights"),
]


def _test_file(name: str) -> Path:
    path = ROOT / name if "/" in name else next(ROOT.glob(f"tests/**/{name}"), ROOT / "tests" / name)
    assert path.is_file(), f"{name}: no such test file"
    return path


def _defines(path: Path, test: str) -> bool:
    if test.endswith("*"):
        return re.search(rf"^def {re.escape(test[:-1])}\w*\(", path.read_text(), re.M) is not None
    return re.search(rf"^def {re.escape(test)}\(", path.read_text(), re.M) is not None


def _references(doc: str) -> list[tuple[str, str]]:
    found, last = [], None
    for file, test in REFERENCE.findall((ROOT / doc).read_text()):
        last = file or last
        assert last, f"{doc}: ::{test} follows no file"
        found.append((last, test))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_the_docs_name_exists(doc):
    references = _references(doc)
    assert references, f"{doc} names no test"
    for file, test in references:
        assert _defines(_test_file(file), test), f"{doc} names {file}::{test}, which is not defined"


@pytest.mark.parametrize("doc, text, test", CLAIMS)
def test_each_claim_found_untested_is_in_the_docs_with_its_test(doc, text, test):
    assert " ".join(text.split()) in " ".join((ROOT / doc).read_text().split()), f"{doc} no longer says {text!r}"
    file, name = test.split("::")
    assert _defines(_test_file(file), name), f"{test} is not defined"
