"""Input-embeds override in the ModelRunner: embeddings equal to the tokens' give exactly the
token path's logits, and replaced positions equal transformers with ``inputs_embeds``."""

import pytest
import torch

import harness

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60]]


def run(runner, prompts, overrides):
    """Prefill (with ``overrides[i]`` = {position: vector} for prompt ``i``), then one greedy
    decode; returns both steps' logits and the greedy tokens."""
    seqs = harness.new_seqs(runner, len(prompts))
    orig = runner.forward

    def forward(fb):
        rows, values, start = [], [], 0
        for prompt, over in zip(prompts, overrides):
            for pos, vec in over.items():
                rows.append(start + pos)
                values.append(vec)
            start += len(prompt)
        if rows:
            fb.input_embeds_indices, fb.input_embeds_values = torch.tensor(rows), torch.stack(values)
        runner.forward = orig
        return orig(fb)

    runner.forward = forward
    try:
        out1 = harness.extend(runner, seqs, prompts).next_token_logits.clone()
        nxt = out1.argmax(-1).tolist()
        out2 = harness.decode(runner, seqs, nxt).next_token_logits.clone()
    finally:
        runner.forward = orig
        harness.release(runner, seqs)
    return out1, out2, nxt


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, harness.make_runner(path)


def test_token_embeddings_give_exactly_the_token_path(setup):
    _, runner = setup
    table = runner.model.get_input_embeddings().weight
    overrides = [{i: table[t].clone() for i, t in enumerate(p)} for p in PROMPTS]
    tokens = run(runner, PROMPTS, [{}, {}])
    embeds = run(runner, PROMPTS, overrides)
    assert torch.equal(tokens[0], embeds[0]) and torch.equal(tokens[1], embeds[1])


def test_replaced_positions_match_transformers_inputs_embeds(setup):
    import transformers

    path, runner = setup
    hidden = runner.model_config.hidden_size
    g = torch.Generator().manual_seed(3)
    overrides = [{2: torch.randn(hidden, generator=g), 3: torch.randn(hidden, generator=g)}, {0: torch.randn(hidden, generator=g)}]
    out1, out2, nxt = run(runner, PROMPTS, overrides)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for i, (prompt, over) in enumerate(zip(PROMPTS, overrides)):
        ids = torch.tensor([prompt + [nxt[i]]])
        with torch.no_grad():
            embeds = ref_model.get_input_embeddings()(ids)
            for pos, vec in over.items():
                embeds[0, pos] = vec
            ref = ref_model(inputs_embeds=embeds).logits[0]
        assert (out1[i] - ref[len(prompt) - 1]).abs().max() <= 1e-4
        assert (out2[i] - ref[len(prompt)]).abs().max() <= 1e-4
    plain = run(runner, PROMPTS, [{}, {}])
    assert (plain[0] - out1).abs().max() > 1e-3  # the override really changed the output
