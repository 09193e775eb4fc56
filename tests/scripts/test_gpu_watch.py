"""scripts/gpu_watch.sh: a script that runs past its time shows where each thread waits, and ends; one that ends in
time runs as python3 would run it."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_watch.sh"


def _watch(tmp_path: Path, seconds: str, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "helper.py").write_text("VALUE = 'from the script directory'\n")
    script = tmp_path / "job.py"
    script.write_text(body)
    return subprocess.run(["bash", str(SCRIPT), seconds, str(script), *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})


def test_a_script_past_its_time_shows_its_stack_and_ends(tmp_path):
    done = _watch(tmp_path, "1", "import time\n\ndef waits_forever():\n    time.sleep(50)\n\nwaits_forever()\n")
    assert done.returncode != 0
    assert "Timeout" in done.stderr and "waits_forever" in done.stderr, done.stderr


def test_a_script_in_time_runs_as_python_runs_it(tmp_path):
    body = ("import sys\nfrom helper import VALUE\nprint(__name__, sys.argv[1:], VALUE)\nsys.exit(3)\n")
    done = _watch(tmp_path, "30", body, "--flag", "x")
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "__main__ ['--flag', 'x'] from the script directory"


def test_a_bad_time_is_a_usage_error(tmp_path):
    done = _watch(tmp_path, "soon", "print('ran')\n")
    assert done.returncode == 2 and "usage:" in done.stderr and "ran" not in done.stdout
