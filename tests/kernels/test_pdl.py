"""Programmatic dependent launch (moelora/kernels/pdl.py): every kernel waits for the kernel before it as its first
statement, the switch, and on a Hopper GPU a chain of producer and consumer kernels replayed from a CUDA graph with
PDL gives the bits it gives without."""
import ast
import importlib
import inspect
import pkgutil
import textwrap
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import KernelInterface

import moelora.kernels
from moelora.kernels import pdl
from moelora.kernels.linear import linear
from moelora.kernels.rms_norm import rms_norm

PACKAGE = Path(moelora.kernels.__file__).parents[1]


def _kernel_modules():
    for info in pkgutil.walk_packages(moelora.kernels.__path__, "moelora.kernels."):
        yield importlib.import_module(info.name)


def _jit_functions() -> dict[str, KernelInterface]:
    found = {}
    for module in _kernel_modules():
        for name, value in vars(module).items():
            # triton.jit's functions (interpreted ones under TRITON_INTERPRET=1)
            if isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__:
                found[name] = value
    return found


def _launched(jit: dict[str, KernelInterface]) -> set[str]:
    """The functions launched (`f[grid](...)`) anywhere in the package."""
    launched = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id in jit:
                launched.add(node.func.value.id)
    return launched


def test_every_kernel_waits_for_the_previous_kernel_first():
    jit = _jit_functions()
    kernels = _launched(jit)
    assert len(kernels) >= 20
    for name in sorted(kernels):
        kernel = jit[name]
        assert "PDL" in kernel.arg_names, f"{name} takes no PDL constexpr"
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        assert first == "wait_for_previous_kernel(PDL)" or first.startswith("wait_for_previous_kernel(PDL, "), \
            f"{name} starts with {first!r}, not the PDL wait"
        if first != "wait_for_previous_kernel(PDL)":  # it may hold the next launch back: then it lets it go itself
            assert "launch_next_kernel(PDL)" in ast.unparse(body[1:]), f"{name} never lets the next launch start"


def test_the_switch(monkeypatch):
    pdl._enabled.cache_clear()
    try:
        assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
        monkeypatch.setenv(pdl.PDL_ENV, "yes")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="MOELORA_PDL must be 0 or 1, got 'yes'"):
            pdl.pdl_launch(torch.device("cuda", 0))
    finally:
        pdl._enabled.cache_clear()


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """GEMMs of many programs, each followed by a one-program-per-row norm that reads all of its output."""
    for w in weights:
        x = rms_norm(linear(x, w), norm, 1e-6)
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("rows", [1, 32, 4096])
def test_a_graph_of_pdl_launches_gives_the_bits_of_plain_launches(monkeypatch, rows):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    weights = [(torch.randn(2048, 2048, generator=gen, device="cuda") / 45).to(torch.bfloat16) for _ in range(24)]
    norm = torch.rand(2048, generator=gen, device="cuda").to(torch.bfloat16) + 0.5
    x = torch.randn(rows, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv(pdl.PDL_ENV, on)
        pdl._enabled.cache_clear()
        assert pdl.pdl_launch(x.device)["PDL"] == (on == "1")
        eager = _chain(x, weights, norm)
        static_x = x.clone()
        _chain(static_x, weights, norm)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static_x, weights, norm)
        outs = []
        for _ in range(5):
            out.fill_(float("nan"))
            graph.replay()
            outs.append(out.clone())
        results[on] = (eager, outs)
    pdl._enabled.cache_clear()
    reference = results["0"][0]
    assert torch.isfinite(reference).all()
    for on, (eager, outs) in results.items():
        assert torch.equal(eager, reference), f"MOELORA_PDL={on}: eager differs"
        for i, got in enumerate(outs):
            assert torch.equal(got, reference), f"MOELORA_PDL={on}: graph replay {i} differs"
