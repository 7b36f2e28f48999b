"""--out as one run's own place, and the run's identity (llmc/train/out_dir.h, atomic_save.h,
loop.h). A symbolic link planted at a name the save machinery uses (.saving.tmp, .saving.done,
log.csv, .lock, a NAME.tmp, DIR.export.tmp, DIR.replaced.tmp) is refused at start and never
followed: the canary it points at survives, unchanged. Foreign files where a save would stage or
write, another run's save in a new run's --out (--steps 0 included) and --export-merged on --out are
refused before the first step. A second run on a directory in use is refused naming the first
one's pid, and the first ends unharmed. A changed config.json refuses the resume naming the field;
a base model replaced during the run refuses the export; --eval-only --resume evaluates the saved
adapter; a file size limit (SIGXFSZ) during a save or an export is one line and leaves no stage.

TRAIN_LLAMA / TRAIN_VIT select other binaries (e.g. /work/baseline's, to see these tests fail)."""
import json
import os
import resource
import shutil
import signal
import subprocess
import time

import pytest

from test_saved_state import BINS, ENV, VIT_MODEL, VIT_TRAIN, args_for, one_line_error, state_step, train
from test_saved_state import llama_model  # noqa: F401 (the fixture)
import st_io  # noqa: E402 (on the path test_saved_state's imports set)

VIT_VAL = os.path.join(os.path.dirname(VIT_TRAIN), "vit_demo_ft_val.bin")


def vit(*extra):
    return args_for("vit", None, *extra)


def refused_at_start(p, *needles):
    """One line naming the needles, and no training step ran (the obstacle was found before it)."""
    err = one_line_error(p, *needles)
    assert "step " not in p.stdout, f"refused only after training:\n{p.stdout[-1500:]}"
    return err


def canary_dir(tmp_path, name="canary.txt"):
    """A directory outside --out with one file in it; returns (dir, file, contents)."""
    d = tmp_path / "elsewhere"
    d.mkdir(exist_ok=True)
    f = d / name
    f.write_text("do not touch")
    return d, f, "do not touch"


def assert_untouched(d, f, text):
    assert f.exists() and f.read_text() == text, f"{f} was changed through the link"
    assert sorted(os.listdir(d)) == [f.name], f"{d} now holds {sorted(os.listdir(d))}"


def start_and_pause(args, log):
    """Starts train_vit, waits for its first step's row in log, and stops it there (SIGSTOP)."""
    p = subprocess.Popen([BINS["vit"]] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if log.exists() and any(line.startswith("1,") for line in log.read_text().splitlines()):
            p.send_signal(signal.SIGSTOP)
            return p
        time.sleep(0.005)
    p.kill()
    pytest.fail(f"the run ended or stalled before it could be paused: {p.communicate()}")


# ---- symbolic links at the fixed names ---------------------------------------------------------

# (name in --out, whether the link points at the canary's directory or at the file)
LINKS = [(".saving.tmp", "dir"), (".saving.done", "dir"), ("log.csv", "file"), (".lock", "file"),
         ("train_state.bin.tmp", "file"), ("adapter_model.safetensors.tmp", "file")]


@pytest.mark.parametrize("name,to", LINKS)
@pytest.mark.parametrize("how", ["new", "resume"])
def test_a_link_in_out_is_refused_and_never_followed(tmp_path, name, to, how):
    out = tmp_path / "run"
    if how == "resume":
        train("vit", vit("--steps", 3, "--stop-at", 1, "--out", out))
    else:
        out.mkdir()
    d, f, text = canary_dir(tmp_path)
    if os.path.lexists(out / name):  # the run's own log.csv or .lock: the link takes its place
        os.unlink(out / name)
    os.symlink(d if to == "dir" else f, out / name)
    run = vit("--steps", 3, *(["--resume", out] if how == "resume" else ["--out", out]))
    p = train("vit", [str(a) for a in run], check=False)
    refused_at_start(p, str(out / name), "symbolic link")
    assert_untouched(d, f, text)
    assert os.path.islink(out / name)


@pytest.mark.parametrize("suffix", [".export.tmp", ".replaced.tmp"])
def test_a_link_beside_the_export_is_refused_and_never_followed(tmp_path, suffix):
    export = tmp_path / "merged"
    export.mkdir()  # an earlier export: the new one moves it to merged.replaced.tmp, then deletes that
    d, f, text = canary_dir(tmp_path, name="config.json")  # a name an export writes: nothing else protects it
    os.symlink(d, str(export) + suffix)
    p = train("vit", vit("--steps", 1, "--out", tmp_path / "run", "--export-merged", export), check=False)
    refused_at_start(p, str(export) + suffix, "symbolic link")
    assert_untouched(d, f, text)


# ---- foreign files where the save stages or writes --------------------------------------------

@pytest.mark.parametrize("name,kind", [(".saving.tmp", "file"), (".saving.done", "file"),
                                       ("adapter_config.json", "dir"), ("train_state.bin", "dir"),
                                       ("log.csv", "dir")])
def test_a_foreign_entry_at_a_save_name_is_refused_at_start(tmp_path, name, kind):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if kind == "dir" else (out / name).write_text("mine")
    p = train("vit", vit("--steps", 1, "--out", out), check=False)
    refused_at_start(p, str(out / name))
    assert (out / name).is_dir() == (kind == "dir")


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_export_merged_on_out_is_refused_at_start(tmp_path, where):
    out = tmp_path / "a" / "run"
    export = {"same": out, "inside": out / "merged", "holding": tmp_path / "a"}[where]
    p = train("vit", vit("--steps", 1, "--out", out, "--export-merged", export), check=False)
    refused_at_start(p, "--export-merged")
    assert not (out / "adapter_model.safetensors").exists()


# ---- one run per directory ---------------------------------------------------------------------

def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_pid(tmp_path):
    out = tmp_path / "run"
    first = start_and_pause(vit("--steps", 400, "--out", out), out / "log.csv")
    try:
        for second in (vit("--steps", 1, "--out", out), vit("--steps", 400, "--resume", out)):
            p = train("vit", second, check=False)
            refused_at_start(p, str(out), f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert state_step(out / "train_state.bin") == 400
    rows = [line for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, 401))


@pytest.mark.parametrize("steps", [0, 2])
def test_a_new_run_into_another_runs_save_is_refused(tmp_path, steps):
    out = tmp_path / "run"
    train("vit", vit("--steps", 2, "--out", out, "--val", VIT_VAL, "--val-batches", 1))
    before = {n: (out / n).read_bytes() for n in ("log.csv", "train_state.bin", "adapter_model.safetensors")}
    p = train("vit", vit("--steps", steps, "--out", out, "--val", VIT_VAL, "--val-batches", 1), check=False)
    refused_at_start(p, str(out), "--resume", "choose another --out")
    assert {n: (out / n).read_bytes() for n in before} == before


def test_steps_0_keeps_a_foreign_log(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.csv").write_text("step,loss\n1,2.5\n")
    p = train("vit", vit("--steps", 0, "--out", out, "--val", VIT_VAL, "--val-batches", 1), check=False)
    one_line_error(p, "log.csv", "--resume")
    assert (out / "log.csv").read_text() == "step,loss\n1,2.5\n"


# ---- the run's identity --------------------------------------------------------------------------

def resume_with_config(llama_model, tmp_path, steps, rewrite, check):
    """A run of train_llama on a copy of the model stopped after step 1 (into tmp_path/run), then resumed
    with the copy's config.json replaced by rewrite(its parsed content), a text: the resume's process."""
    model = tmp_path / "model"
    shutil.copytree(llama_model / "model", model)
    run = ["--model", model] + args_for("llama", llama_model, "--steps", steps)[2:]
    out = tmp_path / "run"
    train("llama", [str(a) for a in run + ["--stop-at", 1, "--out", out]])
    (model / "config.json").write_text(rewrite(json.loads((model / "config.json").read_text())))
    return train("llama", [str(a) for a in run + ["--resume", out]], check=check)


@pytest.mark.parametrize("field,value", [("rope_theta", 500000.0), ("rms_norm_eps", 1e-3)])
def test_a_changed_config_refuses_the_resume_naming_the_field(llama_model, tmp_path, field, value):
    def rewrite(cfg):
        assert cfg.get(field) != value
        return json.dumps(dict(cfg, **{field: value}))
    p = resume_with_config(llama_model, tmp_path, 3, rewrite, check=False)
    one_line_error(p, "train_state.bin", f"now {field}=")
    assert state_step(tmp_path / "run" / "train_state.bin") == 1


def test_a_reformatted_config_still_resumes(llama_model, tmp_path):
    """The identity is config.json's parsed content: key order, spacing and the file's provenance
    fields (transformers_version) do not make another model."""
    def rewrite(cfg):
        cfg["transformers_version"] = "9.9.9"
        return json.dumps(dict(reversed(list(cfg.items()))), indent=4)
    p = resume_with_config(llama_model, tmp_path, 2, rewrite, check=True)
    assert "resumed" in p.stdout and state_step(tmp_path / "run" / "train_state.bin") == 2


def run_with_the_base_replaced(tmp_path, *flags):
    """A ViT run on a copy of the demo model, paused after its first step while another checkpoint
    of the same shapes takes the base's place (as a new file), then let go: its one-line error."""
    model = tmp_path / "model"
    shutil.copytree(VIT_MODEL, model)
    args = ["--model", model] + vit(*flags)[2:]
    p = start_and_pause([str(a) for a in args], tmp_path / "run" / "log.csv")
    try:
        tensors = st_io.load(str(model / "model.safetensors"))
        other = {k: (v * 1.5 if v.dtype.kind == "f" else v) for k, v in tensors.items()}
        st_io.save(str(tmp_path / "other.safetensors"), other)
        os.replace(tmp_path / "other.safetensors", model / "model.safetensors")
    finally:
        p.send_signal(signal.SIGCONT)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 1 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert "changed during the run" in stderr, stderr
    return stderr


def test_a_base_replaced_during_the_run_refuses_the_export(tmp_path):
    out, export = tmp_path / "run", tmp_path / "merged"
    err = run_with_the_base_replaced(tmp_path, "--steps", 400, "--out", out, "--export-merged", export)
    assert "--export-merged" in err
    assert not export.exists() and not os.path.exists(str(export) + ".export.tmp")
    assert state_step(out / "train_state.bin") == 400  # the training itself was saved


def test_a_base_replaced_during_a_full_run_refuses_its_next_save(tmp_path):
    """--full's saves are model directories written from the base's files with the trained tensors
    in place: a base replaced meanwhile would lend the save its frozen tensors (the ViT's key bias),
    so the save is refused like the export, and the save before it stands."""
    out = tmp_path / "run"
    err = run_with_the_base_replaced(tmp_path, "--full", "--lr", "1e-3", "--steps", 400, "--save-every", 200,
                                     "--out", out)
    assert "--full's save" in err
    assert not (out / ".saving.tmp").exists()
    assert not (out / "train_state.bin").exists() or state_step(out / "train_state.bin") < 400


def _val_loss(p):
    return [line for line in p.stdout.splitlines() if line.startswith("val loss")][-1]


def test_eval_only_resume_evaluates_the_saved_adapter(tmp_path):
    out = tmp_path / "run"
    train("vit", vit("--steps", 4, "--stop-at", 2, "--out", out))
    ev = ["--model", VIT_MODEL, "--val", VIT_VAL, "--eval-only", "--lora-rank", 4, "--batch", 50, "--threads", 1]
    resumed = train("vit", [str(a) for a in ev + ["--resume", out]])
    adapter = train("vit", [str(a) for a in ev + ["--adapter", out]])
    base = train("vit", [str(a) for a in ev])
    assert _val_loss(resumed) == _val_loss(adapter)
    assert _val_loss(resumed) != _val_loss(base)


def test_eval_only_resume_of_a_full_run_is_refused(tmp_path):
    out = tmp_path / "run"
    train("vit", vit("--steps", 1, "--full", "--out", out))
    ev = ["--model", VIT_MODEL, "--val", VIT_VAL, "--eval-only", "--full", "--batch", 50, "--threads", 1]
    one_line_error(train("vit", [str(a) for a in ev + ["--resume", out]], check=False), "--model " + str(out))


# ---- file size limit (SIGXFSZ) ---------------------------------------------------------------------

def _limit(n):
    def apply():  # the default action of SIGXFSZ is to kill: the trainer must not leave it so
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return apply


def test_a_file_size_limit_in_a_save_is_one_line_and_leaves_no_stage(tmp_path):
    out = tmp_path / "run"
    train("vit", vit("--steps", 2, "--stop-at", 1, "--out", out))
    limit = os.path.getsize(out / "adapter_model.safetensors") // 2
    p = train("vit", vit("--steps", 2, "--resume", out), check=False, preexec_fn=_limit(limit))
    one_line_error(p, ".tmp")
    assert not (out / ".saving.tmp").exists() and not list(out.rglob("*.tmp"))
    assert state_step(out / "train_state.bin") == 1


def test_a_file_size_limit_in_an_export_is_one_line_and_leaves_no_stage(tmp_path):
    out, export = tmp_path / "run", tmp_path / "merged"
    train("vit", vit("--steps", 1, "--out", out))
    limit = os.path.getsize(os.path.join(VIT_MODEL, "model.safetensors")) // 2
    p = train("vit", ["--model", VIT_MODEL, "--adapter", str(out), "--export-merged", str(export), "--lora-rank", "4",
                      "--threads", "1"], check=False, preexec_fn=_limit(limit))
    one_line_error(p, "merged.export.tmp")
    assert not export.exists() and not os.path.exists(str(export) + ".export.tmp")
