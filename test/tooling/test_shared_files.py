"""The outside artifacts' setting (test/conftest.py): a test that needs llama2.c's tokenizer.bin
is skipped with the path it looked for when LLMC_SHARED_DIR lacks it, fails under CI=true, and
runs when the file is there. Each case runs pytest on one such test in a child process."""
import os
import subprocess
import sys

NEEDS_FILE = "test/formats/test_export_llama.py::test_tokenizer_matches_llama_sentencepiece"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_pytest(tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "LLMC_SHARED_DIR")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NEEDS_FILE],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


def test_absent_artifact_skips_with_its_path(tmp_path):
    p = run_pytest(tmp_path, LLMC_SHARED_DIR=str(tmp_path))
    want = os.path.join(str(tmp_path), "models", "tokenizer.bin") + " not found"
    assert p.returncode == 0 and "1 skipped" in p.stdout and want in p.stdout, p.stdout + p.stderr


def test_absent_artifact_fails_under_ci(tmp_path):
    p = run_pytest(tmp_path, LLMC_SHARED_DIR=str(tmp_path), CI="true")
    assert p.returncode == 1 and "1 failed" in p.stdout and "CI=true requires it" in p.stdout, p.stdout + p.stderr


def test_present_artifact_runs(tmp_path, shared):
    """tokenizer.bin linked into a fresh LLMC_SHARED_DIR: the test runs (and passes) there. The
    file comes from the current setting; without it this case is skipped like the others."""
    src = shared("models/tokenizer.bin")
    (tmp_path / "models").mkdir()
    os.symlink(src, tmp_path / "models" / "tokenizer.bin")
    p = run_pytest(tmp_path, LLMC_SHARED_DIR=str(tmp_path), CI="true")
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
