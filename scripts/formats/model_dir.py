"""A model directory written whole or not at all, by scripts/export/export_llama.py and export_vit.py,
with the rules of the trainers' --export-merged (llmc/train/atomic_save.h): the files go into a sibling
staging directory, OUT.export.tmp, which is renamed to OUT once complete, so a failure (a full disk)
leaves OUT as it was, neither half-written nor created empty. An existing OUT is replaced whole, so no
file of an earlier export outlives it (a stale tokenizer.bin would win over a new tokenizer.json:
llmc/text/model_tokenizer.h reads tokenizer.bin first); so OUT may hold only files an export writes,
and anything else there is refused, never deleted."""
import contextlib
import os
import shutil

EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.bin", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json")


class ModelDirError(Exception):
    """OUT cannot be replaced; the message names it and why."""


def own_file(name):
    """Whether name is a file an export writes, or the temporary file of one."""
    return name in EXPORT_FILES or (name.endswith(".tmp") and name[:-4] in EXPORT_FILES)


def check(out):
    """Refuses an OUT that is not a directory or holds anything an export does not write."""
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ModelDirError(f"{out}: exists and is not a directory")
    foreign = sorted(n for n in os.listdir(out) if not own_file(n) or not os.path.isfile(os.path.join(out, n)))
    if foreign:
        raise ModelDirError(f"{out}: holds {foreign[0]}, which an export does not write; the export replaces the "
                            "whole directory, so give a new or empty one (or one an earlier export wrote)")


@contextlib.contextmanager
def staged(out):
    """Yields the staging directory to write OUT's files into; puts it in OUT's place when the block
    ends without an exception, removes it when one leaves the block."""
    out = os.path.normpath(out)
    if os.path.basename(out) in (".", "..", ""):
        raise ModelDirError(f"{out}: name the directory itself (it is replaced whole), not . or ..")
    check(out)
    stage, old = out + ".export.tmp", out + ".replaced.tmp"
    for left in (stage, old):  # a killed export's leftovers: only export files, else refused
        check(left)
        shutil.rmtree(left, ignore_errors=True)
    os.makedirs(stage)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if os.path.isdir(out):
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)
