"""EngineConfig.lora_target_modules: only the target modules get LoRA slot buffers (by default those the
adapters given at start adapt, all of them without adapters); the others keep lora None and launch no LoRA
kernels. Adapters of modules without slots are refused when read, and outputs do not change."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora.core import ExpertLoRASlots
from moelora.engine.lora_slots import slot_bytes
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError

FAMILY = "qwen3_moe"  # layers 0 and 2 MoE, layer 1 a dense MLP
PROMPTS = [[5, 17, 2, 93, 41], [11, 4, 77, 30, 1, 9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=3, ignore_eos=True)
ATTENTION = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"]
ROUTER, EXPERTS = "model.layers.0.mlp.gate", "model.layers.0.mlp.experts"
DENSE = ["model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"]


def filtered(source, out, keep) -> str:
    """A copy of a PEFT adapter with only the tensors whose names `keep` accepts."""
    out.mkdir()
    tensors = load_file(source / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if keep(k)}, out / "adapter_model.safetensors")
    shutil.copy(source / "adapter_config.json", out / "adapter_config.json")
    return str(out)


@pytest.fixture(scope="module")
def paths(adapters, tmp_path_factory) -> dict[str, str]:
    """full (every module, the router included), partial (q, v, the experts' down), and partial's experts
    alone and attention alone."""
    found, root = adapters(FAMILY), tmp_path_factory.mktemp("targets")
    partial = found["partial"].path
    return {"full": str(found["full"].path), "partial": str(partial),
            "experts": filtered(partial, root / "experts", lambda k: ".mlp.experts" in k),
            "attention": filtered(partial, root / "attention", lambda k: ".mlp.experts" not in k)}


def slotted(engine) -> dict[str, bool]:
    """Each LoRA-able layer of the model: has it slot buffers?"""
    return {name: m.lora is not None for name, m in engine.runner.model.named_modules()
            if hasattr(m, "lora") and getattr(m, "part_names", True)}  # lm_head: a Linear without part names


def test_default_is_what_the_adapters_target(make_engine, paths):
    engine = make_engine(FAMILY, lora_paths={"partial": paths["partial"]})
    has = slotted(engine)
    assert has[ATTENTION[0]] and has[EXPERTS]  # q and v; the experts' down
    assert not has[ATTENTION[1]] and not has[ROUTER] and not any(has[d] for d in DENSE)
    assert ("LoRA slots on self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, mlp.experts.gate_proj, "
            "mlp.experts.up_proj, mlp.experts.down_proj; none on self_attn.o_proj, mlp.gate, mlp.gate_proj, "
            "mlp.up_proj, mlp.down_proj (--lora-target-modules)") in engine.summary()

    experts = make_engine(FAMILY, lora_paths={"experts": paths["experts"]})
    has = slotted(experts)
    # by module, not by last name: the dense MLP's gate_up_proj and down_proj get no slots for the experts'
    assert has[EXPERTS] and has["model.layers.2.mlp.experts"]
    assert not any(v for name, v in has.items() if "experts" not in name)
    assert any(isinstance(b, ExpertLoRASlots) for b in experts.runner.lora.slot_buffers)
    assert slot_bytes(experts.runner.model) < slot_bytes(engine.runner.model)

    everything = make_engine(FAMILY, lora_paths={})  # no adapters at start: any may be loaded later
    assert all(slotted(everything).values())
    assert not any("none on" in line for line in everything.summary())


def test_all_and_explicit_lists(make_engine, paths):
    assert all(slotted(make_engine(FAMILY, lora_paths={"partial": paths["partial"]}, lora_target_modules="all")
                       ).values())
    has = slotted(make_engine(FAMILY, lora_paths={}, lora_target_modules=["qkv_proj", "gate_up_proj"]))
    # gate_up_proj: the dense MLP's gate and up and the routed experts' (SGLang's meaning)
    assert has[ATTENTION[0]] and has[EXPERTS] and has[DENSE[0]]
    assert not has[ATTENTION[1]] and not has[ROUTER] and not has[DENSE[1]]
    has = slotted(make_engine(FAMILY, lora_paths={}, lora_target_modules=["o_proj", "gate"]))
    assert has[ATTENTION[1]] and has[ROUTER] and not has[ATTENTION[0]] and not has[EXPERTS]
    assert [n for n, v in has.items() if v and "mlp" in n] == [ROUTER, "model.layers.2.mlp.gate"]


def test_unknown_names_are_refused(make_engine):
    with pytest.raises(ValueError, match=r"EngineConfig.lora_target_modules \(--lora-target-modules\): the model "
                                         r"has no module 'w1', 'router'; its modules are down_proj, gate, gate_proj, "
                                         r"gate_up_proj, k_proj, o_proj, q_proj, qkv_proj, up_proj, v_proj, or all"):
        make_engine(FAMILY, lora_paths={}, lora_target_modules=["q_proj", "w1", "router"])


def test_an_adapter_at_start_outside_the_targets_is_refused(make_engine, paths):
    with pytest.raises(AdapterError, match=r"adapter 'partial' \(.*\) cannot be served by this engine: 1 problem"
                                           r"(.|\n)*mlp.experts.down_proj \(layers 0, 2\): this engine has no LoRA "
                                           "slots for it; start the engine with --lora-target-modules including "
                                           r"down_proj \(or all\)"):
        make_engine(FAMILY, lora_paths={"partial": paths["partial"]}, lora_target_modules=["qkv_proj"])


def test_a_runtime_load_outside_the_targets_is_refused_and_the_others_serve(make_engine, paths):
    engine = make_engine(FAMILY, lora_paths={"partial": paths["partial"]})
    manager = engine.runner.lora
    want = engine.generate(PROMPTS, GREEDY, lora="partial")
    for load in (lambda: engine.read_lora(paths["full"]), lambda: engine.load_lora("full", paths["full"])):
        with pytest.raises(AdapterError, match="cannot be served by this engine") as e:
            load()
        assert e.value.problems == [
            f"{module} ({layers}): this engine has no LoRA slots for it; start the engine with --lora-target-modules "
            f"including {short} (or all)" for module, layers, short in [
                ("self_attn.o_proj", "layers 0-2", "o_proj"), ("mlp.gate", "layers 0, 2", "gate")]]
        assert str(e.value).startswith(f"adapter {paths['full']} cannot be served")
    assert manager.names == ["partial"] and manager.pool.names == ["partial"] and "full" not in manager.in_flight
    got = engine.generate([p for p in PROMPTS for _ in (0, 1)], GREEDY, lora=["partial", None] * len(PROMPTS))
    assert [o.token_ids for o in got[::2]] == [o.token_ids for o in want]
    engine.load_lora("attention", paths["attention"])  # within the targets
    assert len(engine.generate(PROMPTS[:1], GREEDY, lora="attention")[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("adapter", ["partial", "experts", "attention"])
def test_outputs_do_not_change(make_engine, paths, adapter):
    """The same tokens and log-probabilities with slots on the adapter's modules alone as on every module, the
    base model's rows beside the adapter's included."""
    lora_paths = {adapter: paths[adapter]}
    default, everything = (make_engine(FAMILY, lora_paths=lora_paths, lora_target_modules=t) for t in (None, "all"))
    assert slot_bytes(default.runner.model) < slot_bytes(everything.runner.model)
    loras = [adapter, None] * len(PROMPTS)
    jobs = [[p for p in PROMPTS for _ in (0, 1)], [GREEDY, SAMPLED] * len(PROMPTS), loras]
    got, want = default.generate(*jobs), everything.generate(*jobs)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    for a, b in zip(default.prompt_logprobs(PROMPTS, adapter), everything.prompt_logprobs(PROMPTS, adapter)):
        assert torch.equal(a, b)
