"""scripts/gpu_common.sh saves the Triton cache at exit in 15 MiB parts only where every part comes back: a call
returns 8 files, the other files under $OUT among them."""
import os
import shutil
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _save(tmp_path: Path, cache_mib: int, other_files: int, **env_extra: str) -> tuple[list[str], str]:
    """Source gpu_common.sh with a Triton cache of cache_mib MiB of random bytes and other_files files under $OUT
    (device.txt, which the script writes, counts as one); the part files saved, and device.txt."""
    tree, out, cache = tmp_path / "tree", tmp_path / "out", tmp_path / "cache"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPTS / "gpu_common.sh", tree / "scripts")
    cache.mkdir()
    (cache / "kernel.bin").write_bytes(os.urandom(cache_mib << 20))  # random: gzip leaves it its size
    out.mkdir()
    for i in range(other_files - 1):
        (out / f"run{i}.log").write_text("x\n")
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "TRITON_CACHE_DIR": str(cache), "HOME": str(tree), **env_extra}
    done = subprocess.run(["bash", "-c", "source scripts/gpu_common.sh /unused > /dev/null"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return sorted(p.name for p in out.glob("triton_cache.part-*")), (out / "device.txt").read_text()


def test_parts_are_saved_where_they_all_come_back(tmp_path):
    parts, _ = _save(tmp_path, 20, other_files=6)
    assert parts == ["triton_cache.part-00", "triton_cache.part-01"]


def test_no_part_is_saved_where_the_last_would_stay_behind(tmp_path):
    parts, device = _save(tmp_path, 20, other_files=7)
    assert parts == [] and "triton cache not saved" in device and "room for 1 of the 8 files" in device


def test_the_parts_limit_still_holds(tmp_path):
    parts, device = _save(tmp_path, 20, other_files=1, TRITON_CACHE_PARTS="1")
    assert parts == [] and "triton cache not saved: over 15 MiB" in device
