"""`moelora demo` builds its model and adapters once, then serves them in one mixed batch."""
from moelora.cli import main
from moelora.demo import ADAPTERS, PROMPTS


def test_demo_builds_once_and_adapters_change_outputs(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--max-tokens", "6"]) == 0
    built = {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*") if p.is_file()}
    first = capsys.readouterr().out
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--max-tokens", "6"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*") if p.is_file()} == built  # cached
    assert capsys.readouterr().out == first  # deterministic
    models = len(ADAPTERS) + 1
    assert f"all {models} completions differ on {len(PROMPTS)} of {len(PROMPTS)} prompts" in first
