"""scripts/ci/check_deps.sh, which `make test` runs first: with something missing it names it in
one line with the installer to run and exits 1; with everything there it says so and exits 0."""
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "ci", "check_deps.sh")


def check(*args, **env):
    return subprocess.run(["bash", SCRIPT, *args], env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)


def test_missing_pieces_named_in_one_line(tmp_path):
    p = check(str(tmp_path / "python3"), HF_PYTHON=str(tmp_path / "hf" / "python"))
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and p.stdout == "", p.stdout + p.stderr
    assert str(tmp_path / "python3") in err and str(tmp_path / "hf" / "python") in err
    assert "sudo bash scripts/ci/install_deps.sh" in err


def fake_python(path, missing, then="exec /usr/bin/python3 \"$@\""):
    """A python3 that finds no module `missing` and otherwise runs `then` (a venv: exit 0, it has all)."""
    path.write_text(f"#!/bin/sh\ncase \"$2\" in *\\'{missing}\\'*) exit 1;; esac\n{then}\n")
    path.chmod(0o755)
    return str(path)


def test_a_python_without_a_module_is_named(tmp_path):
    # a python3 whose torch cannot be found: the module and its Debian package are named
    p = check(fake_python(tmp_path / "python3", "torch"), HF_PYTHON=fake_python(tmp_path / "hf", "-", "exit 0"))
    assert p.returncode == 1 and "torch (python3-torch)" in p.stderr and "numpy" not in p.stderr, p.stderr
    # one without jinja2 (scripts/data/prepare_text.py renders chat templates with it)
    p = check(fake_python(tmp_path / "python3j", "jinja2"), HF_PYTHON=fake_python(tmp_path / "hf", "-", "exit 0"))
    assert p.returncode == 1 and "jinja2 (python3-jinja2)" in p.stderr and "jinja2 in" not in p.stderr, p.stderr
    # one without llama-cpp-python (llama.cpp, the judge of scripts/export/export_gguf.py's files)
    p = check(fake_python(tmp_path / "python3l", "llama_cpp"), HF_PYTHON=fake_python(tmp_path / "hf", "-", "exit 0"))
    assert p.returncode == 1 and "llama_cpp (pip llama-cpp-python)" in p.stderr, p.stderr
    # a venv without jinja2 (transformers' chat templates)
    p = check("/usr/bin/python3", HF_PYTHON=fake_python(tmp_path / "hf2", "jinja2", "exit 0"))
    assert p.returncode == 1 and "jinja2 in" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_nothing_missing_passes(tmp_path):
    # the suite's own interpreter has everything but maybe the venv's jinja2; a fake venv finds all
    p = check("/usr/bin/python3", HF_PYTHON=fake_python(tmp_path / "hf", "-", "exit 0"))
    assert p.returncode == 0 and "found" in p.stdout, p.stdout + p.stderr


def test_install_as_root_installs_then_checks_again(tmp_path):
    """`make test` passes --install: as root (CI, a fresh container) a missing piece is installed by
    the installer, said in one line, and the check runs again (here the fake installer makes the
    fake python find torch)."""
    if os.geteuid() != 0:  # CI runs as root
        pytest.skip("the installing branch needs root; without it --install is the check alone (tests above)")
    marker = tmp_path / "installed"
    py = tmp_path / "python3"
    py.write_text(f"#!/bin/sh\ncase \"$2\" in *\\'torch\\'*) [ -e {marker} ] || exit 1;; esac\nexec /usr/bin/python3 \"$@\"\n")
    py.chmod(0o755)
    hf = fake_python(tmp_path / "hf", "-", "exit 0")
    installer = tmp_path / "install.sh"
    installer.write_text(f"touch {marker}\n")
    p = check("--install", str(py), HF_PYTHON=hf, CHECK_DEPS_INSTALLER=f"bash {installer}")
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and marker.exists(), p.stdout + p.stderr
    assert lines[0] == "make test: missing torch (python3-torch); installing them with scripts/ci/install_deps.sh (as root)", lines
    assert lines[-1].startswith("check-deps: ") and p.stderr == ""
    # an installer that fails: one line, exit 1
    marker.unlink()
    installer.write_text("exit 3\n")
    p = check("--install", str(py), HF_PYTHON=hf, CHECK_DEPS_INSTALLER=f"bash {installer}")
    assert p.returncode == 1 and p.stderr.strip() == "make test: scripts/ci/install_deps.sh failed (exit 3)", p.stderr
    # an installer that runs but leaves something missing: the usual line, exit 1
    installer.write_text("true\n")
    p = check("--install", str(py), HF_PYTHON=hf, CHECK_DEPS_INSTALLER=f"bash {installer}")
    assert p.returncode == 1 and "torch (python3-torch)" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
