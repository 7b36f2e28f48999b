"""The NCCL emulation (test/emu/emu_nccl.h) that lets CI run the trainers' NCCL code path on the
CPU emulator: its collectives compute what NCCL's documentation says, on 1, 2 and 3 ranks, and
misuse that a GPU would show as a hang or as garbage ends the job with one NCCL error line,
including stream-order races (a collective on a second stream that does not wait for its input,
or whose input is overwritten while it is in flight)."""
import os

import pytest

from cuda_backend import REPO, mpirun, need, run

PROBE = os.path.join(REPO, "build/emu/emu_nccl_probe")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_collectives_compute_what_nccl_defines(ranks):
    p = run([need(PROBE), "ok"]) if ranks == 1 else mpirun(ranks, PROBE, ["ok"])
    assert f"emu_nccl_probe: {ranks} ranks: all-reduce, reduce-scatter (out of place, in place), all-gather (fp32, bf16), stream order ok" in p.stdout


@pytest.mark.parametrize("mode, message", [
    ("host-pointer", "ncclAllReduce: a buffer (send"),
    ("bad-in-place", "ncclAllGather: sendbuff overlaps recvbuff but is not recvbuff + rank * sendcount"),
    ("count-mismatch", "ncclAllReduce: collective #1 differs across ranks"),
    ("no-broadcast", "unique id differs from rank 0's (was it broadcast?)"),
])
def test_misuse_is_reported(mode, message):
    p = mpirun(2, PROBE, [mode], check=False)
    assert p.returncode != 0, p.stdout
    assert "NCCL error at test/cuda/emu_nccl_probe.cu" in p.stderr and message in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("mode, message", [
    ("missing-wait", "emu: race: ncclAllReduce issued on stream"),
    ("write-in-flight", "emu: race: the input of ncclAllReduce changed between its issue and its run"),
])
def test_stream_races_are_reported(mode, message):
    """The races a GPU would only show as occasional wrong sums: the emulator reports them."""
    p = run([need(PROBE), mode], check=False, env={"LLMC_NCCL_SELFTEST": "1"})
    assert p.returncode != 0, p.stdout
    assert message in p.stderr, p.stderr[-2000:]
