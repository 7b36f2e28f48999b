"""What every test folder shares: the folders on sys.path (below), and where the tests find files
this repository does not ship, and what happens without them.

A few tests use llama2.c's released files (stories260K.bin, its 512-token tok512.bin, and the
LLaMA tokenizer.bin; github.com/karpathy/llama2.c). They are read from ONE folder: the
environment variable LLMC_SHARED_DIR, by default ../shared beside the repository, laid out as
models/stories260K.bin, models/tok512.bin, models/tokenizer.bin. When a file is absent its test
is skipped with the path it looked for, so a fresh clone passes `make test` alone; under CI=true
an absent file fails the test instead, so CI cannot turn green by skipping.
"""
import os
import sys
from types import SimpleNamespace

import pytest

TEST_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TEST_DIR)
# The tests sit in one folder per kind (docs/testing.md) and import modules across them: the case
# tables and PyTorch references of model/, cuda/'s cuda_backend, and helpers of other tests
# (test_llama_train's tiny model, test_llama_cuda's tolerances). Every folder goes on sys.path before
# a test module is imported, so one file runs alone as well as in the whole suite (pytest itself
# puts only the running test's own folder there). The file names are unique across the folders.
KINDS = ("model", "cuda", "system", "formats", "tooling")
sys.path[:0] = [os.path.join(TEST_DIR, k) for k in KINDS]
SHARED_DIR = os.path.abspath(os.environ.get("LLMC_SHARED_DIR") or os.path.join(REPO, "..", "shared"))


def shared_file(relpath):
    """The path of an outside artifact under LLMC_SHARED_DIR; skips the calling test when it is
    absent (fails it under CI=true)."""
    path = os.path.join(SHARED_DIR, relpath)
    if os.path.isfile(path):
        return path
    why = f"{path} not found (outside artifact: set LLMC_SHARED_DIR, see test/conftest.py)"
    if os.environ.get("CI") == "true":
        pytest.fail(why + "; CI=true requires it", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def shared():
    """shared("models/x.bin"): the path of an outside artifact, or a skip (a failure under CI)."""
    return shared_file


@pytest.fixture
def stories260k():
    """llama2.c's stories260K checkpoint and its 512-token tokenizer."""
    return SimpleNamespace(ckpt=shared_file("models/stories260K.bin"), tok=shared_file("models/tok512.bin"))
