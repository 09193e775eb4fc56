"""`moelora demo` on the bundled trained model: the adapters do what they advertise on prompts that are
not in the training corpus, mostly through their expert LoRA, and changed files are refused."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable

import pytest

from moelora.cli import main
from moelora.demo import ADAPTERS, ASSETS, NO_EXPERTS, PROMPTS, DemoRun, run, verify
from tests.support import title_share, upper_share

# Written for the test, none in the corpus (Python's docstrings): sentence openings of the kind it has.
HELD_OUT = ["The number of bytes written", "An optional argument", "Each item of the sequence",
            "Raise an error if the path"]


@pytest.fixture(scope="module")
def held_out() -> DemoRun:
    return run(max_tokens=10, prompts=HELD_OUT)


def texts(result: DemoRun, model: str) -> list[str]:
    found = [t for c in result.completions if c.model == model for t in (c.greedy, c.sampled)]
    assert len(found) == 2 * len(HELD_OUT) and all(t.strip() for t in found), f"{model}: {found}"
    return found


def share(result: DemoRun, model: str, measure: Callable[[str], float]) -> float:
    """`measure` over the model's greedy and sampled completions of every held-out prompt."""
    return measure(" ".join(texts(result, model)))


def test_shout_answers_in_upper_case_through_its_experts(held_out):
    assert share(held_out, "base", upper_share) < 0.2
    assert share(held_out, "shout", upper_share) >= 0.9, texts(held_out, "shout")
    assert share(held_out, "shout" + NO_EXPERTS, upper_share) < 0.4, texts(held_out, "shout" + NO_EXPERTS)


def test_title_answers_in_title_case_through_some_experts(held_out):
    assert share(held_out, "base", title_share) < 0.3
    assert share(held_out, "title", title_share) >= 0.9, texts(held_out, "title")
    assert share(held_out, "title" + NO_EXPERTS, title_share) < 0.5, texts(held_out, "title" + NO_EXPERTS)
    assert share(held_out, "title", upper_share) < 0.5  # Title Case, not UPPER CASE


def test_demo_says_what_it_loads_and_prints_the_batch(capsys):
    assert main(["demo", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f"the bundled demo from {ASSETS} (files checked against its SHA256SUMS)" in out
    assert "not random weights" in out
    assert re.search(r"adapter shout: .*target-parameters.*covers experts 0-7 of layers 0-3", out), out
    assert re.search(r"adapter title: .*expert-modules.*covers experts 0-3 of layers 0-3", out), out
    for prompt in PROMPTS:
        assert repr(prompt) in out
    for model in ("base", *ADAPTERS, *(a + NO_EXPERTS for a in ADAPTERS)):
        assert re.search(rf"^  {re.escape(model)} +greedy  \| \S", out, re.M), model
    assert re.search(r"^\d+ tokens in [\d.]+ s: \d+ tokens/s", out, re.M), out


def test_changed_or_missing_files_are_refused(tmp_path, capsys):
    copy = tmp_path / "demo"
    shutil.copytree(ASSETS, copy)
    weights = copy / "shout" / "adapter_model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(changed)
    (copy / "title" / "adapter_config.json").unlink()
    assert main(["demo", "--dir", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "shout/adapter_model.safetensors (changed), title/adapter_config.json (missing)" in err, err


@pytest.mark.parametrize("sums, message", [
    (b"", "does not list model/config.json, shout/adapter_config.json, title/adapter_config.json: not the demo's "
          "files"),
    (b"0123  model/config.json\n", "line 1: expected '<sha256 in hex>  <file>' (sha256sum's format), got "
                                   "'0123  model/config.json'"),
    (b"\xff\xfe\x00", "not UTF-8 text"),
])
def test_a_sha256sums_that_is_not_the_demos_is_one_error_naming_it(tmp_path, capsys, sums, message):
    (tmp_path / "SHA256SUMS").write_bytes(sums)
    assert main(["demo", "--dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"moelora demo: error: {tmp_path / 'SHA256SUMS'}")
    with pytest.raises(ValueError, match=re.escape(message)):
        verify(tmp_path)


def test_the_files_name_no_machine_path():
    """The adapters name their base by its directory beside them (PEFT writes the path it was loaded
    from), and no file holds a path of the machine that trained them."""
    for name in ADAPTERS:
        config = json.loads((ASSETS / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "model" and (ASSETS / "model" / "config.json").is_file()
    sums = (ASSETS / "SHA256SUMS").read_text().splitlines()
    for line in sums:
        text = (ASSETS / line.split("  ", 1)[1]).read_bytes()
        assert b"/work/" not in text and b"/home/" not in text and b"/tmp/" not in text, line
