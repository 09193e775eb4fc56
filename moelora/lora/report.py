"""What `moelora inspect` shows about an adapter: format, PEFT version, rank and scaling per module
and projection, experts covered per layer, memory per GPU slot, and every problem found.

Without a base model only the file is described (ranks from tensor shapes, scaling from the config);
with one, the canonical adapter is built and everything is checked against the model."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from moelora.lora.adapter import AdapterFile, canonicalize, read_adapter
from moelora.lora.canonical import Adapter
from moelora.lora.errors import AdapterError
from moelora.lora.experts import PARAM_NAMES, wrapped_params
from moelora.lora.formats import Kind
from moelora.lora.model_shapes import ModelShapes, format_ranges, load_model_shapes

SLOT_ELEMENT_BYTES = 2  # GPU slots hold the activations' dtype: bf16/fp16 when serving


def inspect_adapter(path: str | Path, model: str | Path | None = None, max_lora_rank: int | None = None,
                    slot_rank: int | None = None) -> dict:
    """A JSON-serialisable report; `problems` is empty when the adapter can be served as it is. `max_lora_rank`: the
    largest rank served; `slot_rank`: the rank of the engine's GPU slots, for their memory (default: the adapter's
    largest)."""
    report: dict = {"adapter": str(path), "problems": []}
    try:
        file = read_adapter(path)
    except AdapterError as e:
        report["problems"] = e.problems
        return report
    config = file.config
    report |= {"file": file.file_name, "formats": list(file.formats) or ["modules only"], "peft_version": config.peft_version,
               "config": {"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora,
                          "rank_pattern": config.rank_pattern, "alpha_pattern": config.alpha_pattern,
                          "target_modules": config.target_modules, "target_parameters": list(config.target_parameters)},
               "problems": list(file.problems), "left_out": list(file.left_out)}
    report["modules"] = _group_rows(_file_rows(file, report["problems"]))
    if max_lora_rank is not None:
        report["problems"] += [f"{row['name']} (layers {row['layers']}): rank {row['rank']} is above the engine's "
                               f"max_lora_rank={max_lora_rank}" for row in report["modules"]
                               if row["rank"] > max_lora_rank]
    report["experts_covered"] = _file_coverage(file)
    if model is None:
        return report
    try:
        shapes = load_model_shapes(model)
        adapter = canonicalize(file, shapes, max_lora_rank)
    except AdapterError as e:
        report["problems"] = e.problems
        return report
    report["model"] = {"model_type": shapes.model_type, "layers": shapes.num_layers, "experts": shapes.num_experts,
                       "hidden_size": shapes.hidden_size, "moe_intermediate_size": shapes.moe_intermediate_size}
    report["modules"] = _group_rows(_canonical_rows(adapter))
    report["experts_covered"] = _canonical_coverage(adapter, shapes.num_experts)
    report["memory"] = _memory(adapter, shapes, slot_rank or adapter.max_rank)
    return report


def _file_rows(file: AdapterFile, problems: list[str]):
    """(name, rank, scaling, layer) per pair, rank as the tensors give it (PEFT's r for target_parameters); a pair
    whose A gives no rank is a problem instead."""
    for p, name in _pair_names(file):
        if p.kind is Kind.PARAM_WRAPPER:  # E, and so r from A's rows, needs the model
            param = name.removeprefix("experts.")
            r, alpha = file.config.rank_and_alpha(f"{p.peft_path}.{PARAM_NAMES.get(param, param)}")
        else:
            rank_dim = 1 if p.kind is Kind.STACKED else 0
            if p.a.dim() != rank_dim + 2 or p.a.shape[rank_dim] < 1:
                problems.append(f"{p.a_key}: shape {tuple(p.a.shape)} gives no rank (expected "
                                f"{'[experts, r, in]' if rank_dim else '[r, in]'} with r >= 1)")
                continue
            r = p.a.shape[rank_dim]
            alpha = file.config.rank_and_alpha(file.config.pattern_path(p.peft_path))[1]
        yield name, r, file.config.scaling(r, alpha), p.layer


def _pair_names(file: AdapterFile):
    """(pair, name): module name, or 'experts.<projection>' for the expert formats."""
    wrappers = defaultdict(set)
    for p in file.pairs:
        if p.kind is Kind.PARAM_WRAPPER:
            wrappers[p.layer].add(p.name)
    for p in file.pairs:
        if p.kind is Kind.MODULE:
            yield p, p.name
        elif p.kind is Kind.PARAM_WRAPPER:
            yield p, "experts." + " or ".join(wrapped_params(p, wrappers[p.layer], file.config))
        else:
            yield p, f"experts.{p.name}"


def _canonical_rows(adapter: Adapter):
    for layer, lora in adapter.layers.items():
        for name, m in lora.modules.items():
            yield name, m.rank, m.scaling, layer
        for name, ex in lora.experts.items():
            for rank, scaling in sorted({(int(r), float(s)) for r, s in zip(ex.ranks, ex.scaling) if r > 0}):
                yield f"experts.{name}", rank, scaling, layer


def _group_rows(rows) -> list[dict]:
    layers = defaultdict(set)
    for name, rank, scaling, layer in rows:
        layers[(name, rank, round(scaling, 6))].add(layer)
    return [{"name": n, "rank": r, "scaling": s, "layers": format_ranges(ls)} for (n, r, s), ls in sorted(layers.items())]


def _file_coverage(file: AdapterFile) -> list[dict]:
    """Per-expert modules name their experts; the fused formats cover every expert of a layer."""
    covered = defaultdict(lambda: defaultdict(set))
    for p, name in _pair_names(file):
        if p.kind is Kind.EXPERT_MODULE:
            covered[p.layer][name].add(p.expert)
        elif p.kind is not Kind.MODULE:
            covered[p.layer][name] = "all"
    per_layer = {layer: {name: e if e == "all" else format_ranges(e) for name, e in sorted(c.items())}
                 for layer, c in covered.items()}
    return _group_layers(per_layer)


def _canonical_coverage(adapter: Adapter, num_experts: int) -> list[dict]:
    per_layer = {}
    for layer, lora in adapter.layers.items():
        if lora.experts:
            per_layer[layer] = {f"experts.{proj}": f"{int(ex.covered.sum())}/{num_experts}"
                                + ("" if ex.covered.all() else f" ({format_ranges(ex.covered.nonzero().flatten().tolist())})")
                                for proj, ex in lora.experts.items()}
    return _group_layers(per_layer)


def _group_layers(per_layer: dict[int, dict]) -> list[dict]:
    """Consecutive layers with the same coverage share one row."""
    groups = defaultdict(set)
    for layer, coverage in per_layer.items():
        groups[tuple(sorted(coverage.items()))].add(layer)
    return [{"layers": format_ranges(ls), **dict(c)} for c, ls in sorted(groups.items(), key=lambda g: min(g[1]))]


def _memory(adapter: Adapter, shapes: ModelShapes, rank: int) -> dict:
    """Bytes of one GPU slot at `rank`: the expert slot buffers of every MoE layer (a_gate/a_up [E, R, H],
    b_gate/b_up [E, R, I], a_down [E, R, I], b_down [E, R, H]) and the adapter's other modules."""
    h, i, e = shapes.hidden_size, shapes.moe_intermediate_size, shapes.num_experts
    experts = len(shapes.moe_layers) * 3 * e * rank * (h + i) * SLOT_ELEMENT_BYTES
    modules = sum(rank * sum(shapes.modules[layer][name]) * SLOT_ELEMENT_BYTES
                  for layer, lora in adapter.layers.items() for name in lora.modules)
    return {"slot_rank": rank, "slot_dtype_bytes": SLOT_ELEMENT_BYTES, "expert_slot_bytes": experts,
            "module_slot_bytes": modules, "canonical_cpu_bytes": adapter.num_bytes()}


def format_report(report: dict) -> str:
    """The report as text for a terminal."""
    lines = [f"adapter   {report['adapter']}" + (f" ({report['file']})" if "file" in report else "")]
    if "formats" in report:
        c = report["config"]
        lines += [f"format    {', '.join(report['formats'])}; peft {report['peft_version'] or 'unknown'}",
                  f"config    r={c['r']} lora_alpha={c['lora_alpha']} rslora={c['use_rslora']} "
                  f"rank_pattern={c['rank_pattern']} alpha_pattern={c['alpha_pattern']}"]
    if "model" in report:
        m = report["model"]
        lines.append(f"model     {m['model_type']}: {m['layers']} layers, {m['experts']} experts, hidden "
                     f"{m['hidden_size']}, expert intermediate {m['moe_intermediate_size']}")
    if report.get("modules"):
        lines.append("modules")
        width = max(len(row["name"]) for row in report["modules"])
        lines += [f"  {row['name']:<{width}}  r={row['rank']:<4} scaling={row['scaling']:<10g} layers {row['layers']}"
                  for row in report["modules"]]
    if report.get("experts_covered"):
        lines.append("experts covered")
        lines += ["  layers {}: {}".format(row["layers"], ", ".join(f"{k} {v}" for k, v in row.items() if k != "layers"))
                  for row in report["experts_covered"]]
    if "memory" in report:
        mem, mib = report["memory"], 2**20
        lines.append(f"memory    per GPU slot at rank {mem['slot_rank']} ({8 * mem['slot_dtype_bytes']}-bit): experts "
                     f"{mem['expert_slot_bytes'] / mib:.2f} MiB, other modules {mem['module_slot_bytes'] / mib:.2f} MiB; "
                     f"canonical on CPU {mem['canonical_cpu_bytes'] / mib:.2f} MiB")
    elif "formats" in report and not report["problems"]:
        lines.append("memory    needs --model")
    if report.get("left_out"):
        lines.append(f"left out  {len(report['left_out'])} tensor(s) of training-only state (PEFT's inference reads "
                     "none of them)")
        lines += [f"  - {key}" for key in report["left_out"]]
    lines.append("problems  " + ("none" if not report["problems"] else f"{len(report['problems'])}"))
    lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)
