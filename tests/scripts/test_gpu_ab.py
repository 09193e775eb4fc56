"""scripts/gpu_ab.sh: one call runs a command on the tree, with each patch applied in turn, and on the tree again,
and puts the tree back; a patch that does not apply stops it before any run."""
import shutil
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _tree(tmp_path: Path) -> Path:
    """A tree of the two scripts and one file, and a patch that changes the file."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("gpu_ab.sh", "gpu_common.sh"):
        shutil.copy(SCRIPTS / name, tree / "scripts" / name)
    (tree / "value.txt").write_text("a\n")
    (tree / "ab.patch").write_text("--- a/value.txt\n+++ b/value.txt\n@@ -1 +1 @@\n-a\n+b\n")
    return tree


def _run(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tree / "out"), "TRITON_CACHE_DIR": str(tree / "no-cache"),
           "HOME": str(tree)}
    return subprocess.run(["bash", "scripts/gpu_ab.sh", *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def test_runs_a_then_b_then_a_and_restores_the_tree(tmp_path):
    tree = _tree(tmp_path)
    done = _run(tree, "ab.patch", "cat", "value.txt")
    assert done.returncode == 0, done.stderr
    assert [(tree / "out" / f"{name}.log").read_text() for name in ("a1", "b", "a2")] == ["a\n", "b\n", "a\n"]
    assert (tree / "value.txt").read_text() == "a\n"


def test_several_patches_run_each_on_the_tree_alone(tmp_path):
    tree = _tree(tmp_path)
    (tree / "other.patch").write_text("--- a/value.txt\n+++ b/value.txt\n@@ -1 +1 @@\n-a\n+c\n")
    done = _run(tree, "ab.patch,other.patch", "cat", "value.txt")
    assert done.returncode == 0, done.stderr
    assert [(tree / "out" / f"{name}.log").read_text() for name in ("a1", "b1", "b2", "a2")] == ["a\n", "b\n", "c\n", "a\n"]
    assert "## b2: other.patch" in done.stdout and (tree / "value.txt").read_text() == "a\n"


def test_a_patch_that_does_not_apply_runs_nothing(tmp_path):
    tree = _tree(tmp_path)
    (tree / "value.txt").write_text("c\n")
    done = _run(tree, "ab.patch", "cat", "value.txt")
    assert done.returncode == 2 and "does not apply to this tree" in done.stderr
    assert not (tree / "out" / "a1.log").exists()
    missing = _run(tree, "no.patch", "cat", "value.txt")
    assert missing.returncode == 2 and "usage: bash scripts/gpu_ab.sh PATCH[,PATCH...] COMMAND" in missing.stderr
    assert "no file no.patch" in missing.stderr
    second = _run(tree, "no.patch,ab.patch", "cat", "value.txt")  # every patch is checked before any run
    assert second.returncode == 2 and not (tree / "out" / "a1.log").exists()
    for empty in ("", ","):
        none = _run(tree, empty, "cat", "value.txt")
        assert none.returncode == 2 and "usage" in none.stderr and not (tree / "out" / "a1.log").exists()
