"""scripts/ci/check_deps.sh, which `make test` runs first: with something missing it names it in
one line with the installer to run and exits 1; with everything there it says so and exits 0."""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "ci", "check_deps.sh")


def check(*args, **env):
    return subprocess.run(["bash", SCRIPT, *args], env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)


def test_missing_pieces_named_in_one_line(tmp_path):
    p = check(str(tmp_path / "python3"), HF_PYTHON=str(tmp_path / "hf" / "python"))
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and p.stdout == "", p.stdout + p.stderr
    assert str(tmp_path / "python3") in err and str(tmp_path / "hf" / "python") in err
    assert "sudo bash scripts/ci/install_deps.sh" in err


def test_a_python_without_a_module_is_named(tmp_path):
    # a python3 whose torch cannot be found: the module and its Debian package are named
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\ncase \"$2\" in *\\'torch\\'*) exit 1;; esac\nexec /usr/bin/python3 \"$@\"\n")
    fake.chmod(0o755)
    p = check(str(fake), HF_PYTHON="/bin/sh")
    assert p.returncode == 1 and "torch (python3-torch)" in p.stderr and "numpy" not in p.stderr, p.stderr


def test_nothing_missing_passes():
    # the suite's own interpreter has everything but maybe the venv; /bin/sh stands in for it
    p = check("/usr/bin/python3", HF_PYTHON="/bin/sh")
    assert p.returncode == 0 and "found" in p.stdout, p.stdout + p.stderr
