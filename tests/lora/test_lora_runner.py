"""LoRA in the ModelRunner: logits equal transformers + peft (TP1 and TP2), a mixed batch
equals each request alone, and bad adapters are refused with the field named."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
import harness  # noqa: E402
from lora_fixtures import make_peft_adapter, peft_logits, run_tp_lora, run_with_adapters  # noqa: E402

from shardline_runtime.lora.lora_config import LoRAAdapterError, LoRAPoolFullError  # noqa: E402

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60]]
TOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora")
    a = make_peft_adapter(base, root / "a", r=4, seed=1)
    b = make_peft_adapter(base, root / "b", r=8, alpha=4, seed=2, target_modules=("q_proj", "v_proj", "down_proj"),
                          use_rslora=True)
    return base, a, b


def lora_runner(base, **kw):
    return harness.make_runner(base, enable_lora=True, max_lora_rank=8, max_loras_per_batch=2, **kw)


run = run_with_adapters


def test_lora_logits_match_peft_and_mixed_batch_equals_alone(adapters):
    base, a, b = adapters
    runner = lora_runner(base)
    runner.lora_manager.load_adapter("a", str(a))
    runner.lora_manager.load_adapter("b", str(b))
    for name, path in (("a", a), ("b", b)):
        for prompt in PROMPTS:
            p1, p2, nxt = run(runner, [prompt], [name])
            ref = peft_logits(base, path, prompt + nxt)
            assert (p1[0] - ref[len(prompt) - 1]).abs().max() <= TOL
            assert (p2[0] - ref[len(prompt)]).abs().max() <= TOL
    base_alone = run(runner, [PROMPTS[0]], [None])
    # the adapter really changes the output
    assert (base_alone[0] - run(runner, [PROMPTS[0]], ["a"])[0]).abs().max() > 1e-2
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    names = ["a", None, "b", "b"]
    mixed = run(runner, prompts, names)
    for i, (p, n) in enumerate(zip(prompts, names)):
        alone = run(runner, [p], [n])
        assert (mixed[0][i] - alone[0][0]).abs().max() <= TOL
        assert (mixed[1][i] - alone[1][0]).abs().max() <= TOL


def test_bad_adapters_are_refused_naming_the_field(adapters, tiny_checkpoint, tmp_path):
    base, a, b = adapters
    runner = lora_runner(base)
    manager = runner.lora_manager
    with pytest.raises(LoRAAdapterError, match="adapter_config.json not found") as e:
        manager.load_adapter("x", str(tmp_path / "nowhere"))
    assert e.value.param == "lora_path"
    high = make_peft_adapter(base, tmp_path / "high", r=16)
    with pytest.raises(LoRAAdapterError, match="exceeds --max-lora-rank 8"):
        manager.load_adapter("x", str(high))
    other = make_peft_adapter(tiny_checkpoint("llama", hidden_size=48), tmp_path / "other", r=4)
    with pytest.raises(LoRAAdapterError, match="wrong base architecture"):
        manager.load_adapter("x", str(other))
    nofile = tmp_path / "nofile"
    shutil.copytree(a, nofile)
    (nofile / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors not found"):
        manager.load_adapter("x", str(nofile))
    dora = tmp_path / "dora"
    shutil.copytree(a, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="use_dora"):
        manager.load_adapter("x", str(dora))
    assert manager.loaded() == [] and manager.slots == [None, None]
    # pool of 2: the third load evicts the least recently used idle adapter, or 503 when both are in use
    manager.load_adapter("a", str(a))
    manager.load_adapter("b", str(b))
    with pytest.raises(LoRAPoolFullError):
        manager.load_adapter("c", str(a), in_use={"a", "b"})
    manager.load_adapter("c", str(a), in_use={"b"})
    assert sorted(x["name"] for x in manager.loaded()) == ["b", "c"]
    with pytest.raises(LoRAAdapterError, match="already loaded") as e:
        manager.load_adapter("c", str(a))
    assert e.value.param == "lora_name"
    manager.unload_adapter("c")
    with pytest.raises(LoRAAdapterError, match="not loaded"):
        manager.unload_adapter("c")


@pytest.mark.slow
def test_tp2_lora_matches_peft(adapters, tmp_path):
    """TP=2 (gloo, CPU): A of row-parallel layers and B of column-parallel layers are sharded,
    and a mixed batch still gives transformers + peft's logits on every rank."""
    base, a, b = adapters
    prompts, names = [PROMPTS[0], PROMPTS[1], PROMPTS[0]], ["a", "b", None]
    ranks = run_tp_lora(2, base, {"a": a, "b": b}, prompts, names, tmp_path)
    for out1, out2, nxt in ranks:
        for i, (p, n) in enumerate(zip(prompts, names)):
            if n is None:
                continue
            ref = peft_logits(base, {"a": a, "b": b}[n], p + [nxt[i]])
            assert (out1[i] - ref[len(p) - 1]).abs().max() <= TOL
            assert (out2[i] - ref[len(p)]).abs().max() <= TOL


def test_tiny_adapter_writer_is_read_like_peft(adapters, tmp_path):
    """``lora/tiny_adapter.py`` (demo and cluster tests) writes the PEFT format: peft reads it
    and gives the same logits as the runtime."""
    from shardline_runtime.lora.tiny_adapter import write_tiny_adapter

    base, _, _ = adapters
    tiny = write_tiny_adapter(tmp_path / "tiny", base, rank=4, seed=3)
    runner = harness.make_runner(base, enable_lora=True, lora_paths=(f"t={tiny}",))
    out, _, _ = run(runner, [PROMPTS[0]], ["t"])
    plain, _, _ = run(runner, [PROMPTS[0]], [None])
    assert (out[0] - peft_logits(base, tiny, PROMPTS[0])[-1]).abs().max() <= TOL
    assert (out[0] - plain[0]).abs().max() > 1e-2


def test_scheduler_refuses_a_request_for_an_adapter_not_loaded(adapters):
    """A request that reaches the scheduler after its adapter was unloaded (a race with the HTTP
    check) is answered with an abort, never run (it would fail inside a forward)."""
    from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
    from shardline_runtime.managers.lora_control import LoRAControl
    from shardline_runtime.managers.request_intake import RequestIntake
    from shardline_runtime.managers.scheduler_output import OutputSender
    from shardline_runtime.sampling.sampling_params import SamplingParams

    class Capture:
        def __init__(self):
            self.messages = []

        def send_pyobj(self, msg):
            self.messages.append(msg)

    base, a, _ = adapters
    runner = lora_runner(base, lora_paths=(f"a={a}",))
    sender, queued = OutputSender(Capture()), []
    lora = LoRAControl(runner.lora_manager, list, sender.send)
    intake = RequestIntake(100, 200, [], lora, sender, queued.append)
    intake.handle(TokenizedGenerateReqInput(rid="r1", input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2),
                                            lora_name="gone"))
    reasons = [m.outs[0].finish.to_dict() for m in sender.socket.messages]
    assert reasons == [{"type": "abort", "message": "LoRA adapter 'gone' is not loaded"}]
    assert not queued
    assert lora.is_loaded("a")


def _decode_with_adapters(runner, prompts, names, steps: int):
    """Greedy decode of ``prompts`` (adapters ``names``); (tokens per step, logits per step)."""
    import harness

    seqs = harness.new_seqs(runner, len(prompts))
    orig = runner.forward

    def forward(fb):
        fb.lora_names = list(names)
        return orig(fb)

    runner.forward = forward
    try:
        logits = [harness.extend(runner, seqs, prompts).next_token_logits.clone()]
        tokens = [logits[-1].argmax(-1).tolist()]
        for _ in range(steps):
            logits.append(harness.decode(runner, seqs, tokens[-1]).next_token_logits.clone())
            tokens.append(logits[-1].argmax(-1).tolist())
    finally:
        runner.forward = orig
        harness.release(runner, seqs)
    return tokens, logits


@pytest.fixture(scope="module")
def lora_decodes(adapters):
    """A mixed batch (a, base, b) decoded eagerly and through the decode-graph static buffers
    (batch 3 runs the graph of 4: one padded row)."""
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.device_graphs import DeviceGraphs

    base, a, b = adapters
    runner = lora_runner(base)
    runner.lora_manager.load_adapter("a", str(a))
    runner.lora_manager.load_adapter("b", str(b))
    prompts, names = [PROMPTS[0], PROMPTS[1], PROMPTS[1]], ["a", None, "b"]
    eager = _decode_with_adapters(runner, prompts, names, steps=4)
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4])
    replayed = []
    original = decode.replay
    decode.replay = lambda fb: replayed.append(fb.batch_size) or original(fb)
    runner.graphs = DeviceGraphs(runner, decode=decode)
    static = _decode_with_adapters(runner, prompts, names, steps=4)
    return eager, static, replayed


def test_lora_decode_goes_through_the_graph_static_buffers(lora_decodes):
    assert lora_decodes[2] == [3, 3, 3, 3]


def test_lora_graph_static_path_gives_the_eager_greedy_tokens(lora_decodes):
    assert lora_decodes[1][0] == lora_decodes[0][0]


def test_lora_graph_static_path_gives_the_eager_logits(lora_decodes):
    eager, static = lora_decodes[0][1], lora_decodes[1][1]
    assert max(float((s - e).abs().max()) for s, e in zip(static, eager)) <= TOL


def test_lora_graph_static_path_applies_each_rows_adapter(lora_decodes):
    """Row 0 (adapter a) and row 2 (adapter b) read the same prompt family as row 1 (base) only
    for rows 1 and 2: their decode logits differ, so the per-row slots were honoured."""
    static = lora_decodes[1][1][1]
    assert float((static[1] - static[2]).abs().max()) > 1e-2


@pytest.mark.gpu
def test_cuda_graphs_are_captured_with_lora(adapters):
    base, a, _ = adapters
    with_lora = lora_runner(base, device="cuda", lora_paths=(f"a={a}",))
    assert with_lora.graphs.report().decode_batch_sizes
