"""The engine against transformers + PEFT in fp32 on CPU, for every family the models provide:
full next-token log-probs within 1e-4 and 16 greedy tokens equal to transformers' greedy
generate, on the base model and on each of two adapters, all in one mixed batch."""
import pytest
import torch

from moelora.engine.sampling_params import SamplingParams
from tests.models.families import FAMILIES, assert_logprobs_close, family_config, hf_logits, hf_model, with_deltas

PROMPTS = [[5, 17, 2, 93, 41, 8, 8, 60, 3], [11, 4, 77, 30, 1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_transformers_and_peft(family, make_engine, adapters):
    engine = make_engine(family)
    config = family_config(family)
    references = {None: hf_model(config)}
    references.update({name: with_deltas(hf_model(config), a.deltas) for name, a in adapters(family).items()})
    jobs = [(prompt, name) for name in references for prompt in PROMPTS]
    prompts, loras = [p for p, _ in jobs], [n for _, n in jobs]

    for (prompt, name), got in zip(jobs, engine.prompt_logprobs(prompts, lora=loras)):
        assert got.dtype == torch.float32 and got.shape == (len(prompt), config.vocab_size)
        assert_logprobs_close(got, hf_logits(references[name], [prompt])[0], f"{name or 'base'} on {prompt}")

    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), lora=loras)
    for model in references.values():
        model.generation_config.eos_token_id = None  # as ignore_eos (min_new_tokens would ban EOS instead)
    for (prompt, name), out in zip(jobs, outputs):
        ids = torch.tensor([prompt])  # an explicit mask: some configs' pad_token_id is a prompt token here
        want = references[name].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out.token_ids == want[0, len(prompt):].tolist(), f"{name or 'base'} on {prompt}"
