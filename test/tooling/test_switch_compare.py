"""scripts/ci/switch_compare.sh without a GPU: its logic on the CPU emulator's trainers
(build/emu/train_llama, build/emu/train_vit) at tiny shapes of the same kinds (SWITCH_COMPARE_TINY=1),
2 steps per run, transformers + PEFT replaced by a canned command. What the emulator can say of
the rows: the script runs a row per switch in its order, reads each run's log.csv right (checked
here against the files), holds the switches that only move where an argument comes from to the
same adapter bytes, marks a failing or differing run and exits 1, and skips what does not fit its
budget with the reason. Speeds on the emulator mean nothing; the GPU run reads those."""
import csv
import os
import re
import subprocess
import time

from cuda_backend import need

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "ci", "switch_compare.sh")
LLAMA_ROWS = ["default", "graph", "gemm", "transformers+PEFT", "lora-fused=0", "lora-fused=1", "gemm+graph",
              "head-chunk=old", "all-old"]
# transformers + PEFT's line as scripts/bench/bench_hf.py prints it, and what it prints without PEFT
FAKE_HF = 'echo "HF $3 plain: 40 tok/s, peak 7.5 MiB (torch.cuda.max_memory_allocated)"'
NO_PEFT = "echo \"ModuleNotFoundError: No module named 'peft'\" >&2; exit 1"


def run(tmp_path, *shapes, **kw):
    hf = tmp_path / "hf.sh"
    hf.write_text(kw.pop("hf", FAKE_HF) + "\n")
    e = dict(os.environ, OMP_NUM_THREADS="2", OUT=str(tmp_path), SWITCH_COMPARE_DIR=str(tmp_path / "work"),
             SWITCH_COMPARE_TINY="1", SWITCH_COMPARE_STEPS="2", SWITCH_COMPARE_HF=f"bash {hf}",
             SWITCH_COMPARE_LLAMA=need(os.path.join(REPO, "build/emu/train_llama")),
             SWITCH_COMPARE_VIT=need(os.path.join(REPO, "build/emu/train_vit")))
    e.update({k: str(v) for k, v in kw.items()})
    t = time.time()
    p = subprocess.run(["bash", SCRIPT, *shapes], env=e, capture_output=True, text=True, timeout=600)
    print(p.stdout, p.stderr[-2000:], f"took {time.time() - t:.1f} s")
    return p, time.time() - t


def table(text):
    """The rows of the markdown table, as dicts keyed by the header."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]


def log_csv(tmp_path, shape, name):
    with open(tmp_path / "work" / shape / f"{name}.out" / "log.csv") as f:
        return list(csv.DictReader(f))


def test_llama_row_per_switch_identical_where_only_arguments_move(tmp_path):
    p, _ = run(tmp_path, "llama3")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = table(p.stdout)
    by = {r["run"]: r for r in rows}
    assert [r["run"] for r in rows] == LLAMA_ROWS
    assert all(r["status"] == "PASS" for r in rows), rows
    assert all(r["shape"] == "llama3 (tiny) 1x64" for r in rows)
    # the table's figures are log.csv's: the last step's loss and norm, the rate's mean after step 1
    for name in ("default", "gemm", "head-chunk=old"):
        rec = log_csv(tmp_path, "llama3", name)
        assert len(rec) == 2
        assert by[name]["loss"] == rec[-1]["loss"] and by[name]["grad norm"] == rec[-1]["grad_norm"]
        assert by[name]["rate"] == f"{float(rec[1]['tokens_per_s']):.1f} tok/s"
    d = by["default"]
    assert d["check"] == "reference" and d["vs ref"] == "-"
    assert "attention: gemm (LLMC_ATTENTION=unset" in d["notes"]  # the emulator has no cuDNN: gemm is the default
    # the graph: the same adapter bytes, checked by the script
    assert by["gemm+graph"]["check"] == "identical to gemm (adapter bytes too)", by["gemm+graph"]
    # on the emulator the default is gemm, so the graph row trains bit for bit there too
    assert (by["graph"]["loss"], by["graph"]["grad norm"]) == (d["loss"], d["grad norm"])
    assert "cuda graph: on" in by["graph"]["notes"]
    # the old head chunk: within the rtol 1e-3 that test_llama_cuda's head-chunk test derives
    # (one bf16 rounding flipped in a few terms of a mean), far inside the script's 1e-2 bound
    for name in ("head-chunk=old",):
        assert abs(float(by[name]["loss"]) - float(d["loss"])) <= 1e-3 * float(d["loss"]), by[name]
        assert by[name]["check"].startswith("ok:"), by[name]
    # LLMC_LORA_FUSED=0 (and all-old, which holds it) rounds every adapted output at another point:
    # the bound of test_llama_cuda's test_cuda_lora_fold_switch, each bf16 order against fp32 (1e-2)
    for name in ("all-old", "lora-fused=0", "lora-fused=1"):
        assert abs(float(by[name]["loss"]) - float(d["loss"])) <= 1e-2 * float(d["loss"]), by[name]
        assert by[name]["check"].startswith("ok:"), by[name]
    assert "rule old, LLMC_HEAD_CHUNK" in by["head-chunk=old"]["notes"]
    # what the binary said of LLMC_LORA_FUSED, or that it was only set (a binary that predates it)
    assert re.search(r"LLMC_LORA_FUSED=0 \(not reported\)|LLMC_LORA_FUSED|[Ff]used", by["lora-fused=0"]["notes"]), by["lora-fused=0"]
    # lora-fused=0: another rounding order, within the bounds, the relative differences stated
    assert re.fullmatch(r"ok: loss \d\.\de[-+]\d\d grad norm \d\.\de[-+]\d\d vs default", by["lora-fused=0"]["check"]), \
        by["lora-fused=0"]
    hf = by["transformers+PEFT"]
    assert hf["rate"] == "40 tok/s" and hf["vs ref"] == f"{40 / float(d['rate'].split()[0]):.2f}x"
    assert hf["notes"] == "peak 7.5 MiB (torch max_memory_allocated)"
    assert "LLMC_HEAD_CHUNK=old" in by["all-old"]["switches"] and "LLMC_LORA_FUSED=0" in by["all-old"]["switches"]
    # the file under $OUT holds the same table
    assert table((tmp_path / "switches.md").read_text()) == rows


def test_failing_and_differing_runs_are_marked_and_exit_1(tmp_path):
    extra = "graph=yes|default|bounds|LLMC_CUDA_GRAPH=yes;unfused-as-default|default|identical|LLMC_LORA_FUSED=0"
    p, _ = run(tmp_path, "vit", hf=NO_PEFT, SWITCH_COMPARE_EXTRA=extra,
               SWITCH_COMPARE_ONLY="default transformers+PEFT gemm+graph graph=yes unfused-as-default")
    assert p.returncode == 1
    by = {r["run"]: r for r in table(p.stdout)}
    assert list(by) == ["default", "transformers+PEFT", "gemm+graph", "graph=yes", "unfused-as-default"]
    assert by["default"]["status"] == "PASS" and by["default"]["rate"].endswith(" img/s")
    # no transformers here is not a failure of ours
    assert by["transformers+PEFT"]["status"] == "NOT RUN" and by["transformers+PEFT"]["check"] == "No module named 'peft'"
    assert by["gemm+graph"]["status"] == "PASS" and by["gemm+graph"]["check"] == "no gemm reference (it did not run or failed)"
    assert by["graph=yes"]["status"] == "FAIL(rc=1)"
    assert "LLMC_CUDA_GRAPH=yes: expected 0 or 1" in by["graph=yes"]["check"]
    assert by["unfused-as-default"]["status"] == "PASS" and \
        by["unfused-as-default"]["check"].startswith("DIFFERS from default")


def test_budget_gives_each_shape_a_share_and_skips_with_the_reason(tmp_path):
    budget = 48  # 12 s a shape: its reference run (2 s here alone) fits on a loaded machine
    p, took = run(tmp_path, "all", SWITCH_COMPARE_BUDGET_S=budget, SWITCH_COMPARE_HF="0")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = table(p.stdout)
    shapes = []
    for r in rows:
        s = r["shape"].split(" ")[0]
        if not shapes or shapes[-1] != s:
            shapes.append(s)
    assert shapes == ["llama3", "packed", "vit", "llama7b"]  # the order of "all", each shape once
    for s in shapes:  # a share each: every shape's reference ran
        first = next(r for r in rows if r["shape"].startswith(s + " "))
        assert first["run"] == "default" and first["status"] == "PASS", first
        ran = [r["status"] != "SKIPPED" for r in rows if r["shape"].startswith(s + " ") and r["run"] != "transformers+PEFT"]
        assert ran == sorted(ran, reverse=True), ran  # skipped only after the last run that ran
    skipped = [r for r in rows if r["status"] == "SKIPPED"]
    assert skipped, "48 s cannot hold some 30 emulator runs of 2 s or more"
    assert all(re.fullmatch(r"SKIPPED: -?\d+ s of this shape's budget share left, a run here took up to \d+ s", r["check"])
               for r in skipped), skipped
    assert [(r["status"], r["check"]) for r in rows if r["run"] == "transformers+PEFT"] == [("NOT RUN", "SWITCH_COMPARE_HF=0")] * 3
    assert took < budget + 10, took


def test_bad_shape_is_one_line_error(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "llama2"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "switch_compare.sh: unknown shape 'llama2' (expected all, llama3, packed, vit, llama7b or demo)\n"


def test_packed_default_that_fell_back_to_gemm_fails(tmp_path):
    """The packed shape exists for cuDNN's ragged path: its default row fails when the trainer's log
    says cuDNN was refused (here a wrapper prints the trainer's refusal line before the emulator's
    trainer runs), while the same line on another shape is only a note."""
    wrapper = tmp_path / "train_llama.sh"
    wrapper.write_text("echo 'attention: cudnn refused B=1 T=32 H=4 KVH=2 hd=16 (planted): gemm runs it'\n"
                       f"exec {need(os.path.join(REPO, 'build/emu/train_llama'))} \"$@\"\n")
    wrapper.chmod(0o755)
    p, _ = run(tmp_path, "packed", "llama3", SWITCH_COMPARE_LLAMA=str(wrapper), SWITCH_COMPARE_ONLY="default")
    assert p.returncode == 1
    by = {r["shape"].split(" ")[0]: r for r in table(p.stdout)}
    assert by["packed"]["status"] == "FAIL" and by["packed"]["check"] == "packed examples not on cuDNN's ragged path"
    assert by["llama3"]["status"] == "PASS" and "cudnn refused" in by["llama3"]["notes"], by["llama3"]
