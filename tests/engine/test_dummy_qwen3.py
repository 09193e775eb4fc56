"""The dummy Qwen3-MoE of the GPU test and the serving benchmark at its tiny size on the CPU: config.json
and a tokenizer smaller than the model's vocabulary are enough to serve 8 adapters in one batch (ids the
tokenizer does not know decode to no text)."""
from tests.engine.dummy_qwen3 import check_adapters_in_one_batch, dummy_qwen3_engine


def test_tiny_dummy_qwen3_serves_8_adapters_in_one_batch(tmp_path):
    engine = dummy_qwen3_engine(tmp_path, tiny=True, device="cpu")
    assert len(engine.tokenizer) < engine.vocab_size
    tokens = check_adapters_in_one_batch(engine)
    assert any(t >= len(engine.tokenizer) for seq in tokens for t in seq)
