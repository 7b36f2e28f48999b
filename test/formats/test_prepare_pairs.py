"""scripts/data/prepare_text.py on preference JSONL (TRL's layouts) into pair shards
(scripts/formats/shards.py, llmc/text/pairdata.h): the tokens against the `tokenizers` library and,
for conversational records, transformers' own chat-template rendering; the implicit-prompt layout
equal to the explicit one; truncation to --seq (prompt from the left, completions from the right)
counted; refusals."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_cases as lc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import shards  # noqa: E402
from test_prepare_text import hf_tok_dir, write_jsonl  # noqa: E402

PREP = os.path.join(lc.REPO, "scripts", "data", "prepare_text.py")
STANDARD = [{"prompt": "Name a permissive license.", "chosen": " MIT.", "rejected": " The GPL, of course."},
            {"prompt": "Ünïcode 😀?", "chosen": " Yes 42", "rejected": " no"}]
CONV = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the GPL?"}],
         "chosen": [{"role": "assistant", "content": "A copyleft license."}],
         "rejected": [{"role": "assistant", "content": "A fruit."}]},
        {"prompt": [{"role": "user", "content": "Hi"}],
         "chosen": [{"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "assistant", "content": "Go away."}]}]


def prepare(tok, jsonl, out, *extra):
    return subprocess.run([sys.executable, PREP, "--tokenizer", str(tok), "--input", str(jsonl), "--out", str(out),
                           "--val-frac", "0", *extra], capture_output=True, text=True, timeout=120)


def ids(arrays):
    return [[int(t) for t in a] for a in arrays]


def test_standard_layout_is_the_library_encoding(tmp_path):
    """Prompt: BOS + the library's encoding; completion: its encoding + EOS (TRL's tokenize_row)."""
    import prepare_text
    d, tok = hf_tok_dir(tmp_path, "smollm2")
    jsonl = tmp_path / "prefs.jsonl"
    write_jsonl(jsonl, STANDARD)
    p = prepare(d / "tokenizer.json", jsonl, tmp_path / "p")
    assert p.returncode == 0, p.stderr
    ours = prepare_text.load_tokenizer(str(d / "tokenizer.json"))
    pairs, vocab = shards.read_pair_shard(str(tmp_path / "p_train.bin"))
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    got = sorted(ids(q) for q in pairs)
    want = sorted([[ours.bos_id] + enc(r["prompt"]), enc(r["chosen"]) + [ours.eos_id], enc(r["rejected"]) + [ours.eos_id]]
                  for r in STANDARD)
    assert got == want and vocab == tok.get_vocab_size(with_added_tokens=True)
    assert "0 prompts cut, 0 completions cut" in p.stdout


def test_conversational_layouts_render_as_transformers(tmp_path):
    """With SmolLM2's template: the prompt is transformers' rendering with add_generation_prompt,
    a completion the rest of the rendering of prompt + completion, then EOS; chosen and rejected
    given as whole conversations (implicit prompt) make the same shard."""
    from test_chat_template import smollm2_template, transformers_render
    import prepare_text
    d, tok = hf_tok_dir(tmp_path, "smollm2", smollm2_template(), "<|im_start|>", "<|im_end|>")
    tmpl = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    write_jsonl(tmp_path / "conv.jsonl", CONV)
    write_jsonl(tmp_path / "implicit.jsonl", [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                                              for r in CONV])
    for name in ("conv", "implicit"):
        p = prepare(d / "tokenizer.json", tmp_path / f"{name}.jsonl", tmp_path / name)
        assert p.returncode == 0, p.stderr
    cases = []
    for r in CONV:
        for msgs, agp in ((r["prompt"], True), (r["prompt"] + r["chosen"], False), (r["prompt"] + r["rejected"], False)):
            cases.append(dict(template=tmpl, messages=msgs, add_generation_prompt=agp, bos_token="<|im_start|>",
                              eos_token="<|im_end|>"))
    texts = transformers_render(cases)
    eos = prepare_text.load_tokenizer(str(d / "tokenizer.json")).eos_id
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    want = []
    for i in range(len(CONV)):
        prompt, chosen, rejected = texts[3 * i: 3 * i + 3]
        assert chosen.startswith(prompt) and rejected.startswith(prompt)
        want.append([enc(prompt), enc(chosen[len(prompt):]) + [eos], enc(rejected[len(prompt):]) + [eos]])
    conv = sorted(ids(q) for q in shards.read_pair_shard(str(tmp_path / "conv_train.bin"))[0])
    implicit = sorted(ids(q) for q in shards.read_pair_shard(str(tmp_path / "implicit_train.bin"))[0])
    assert conv == sorted(want) and implicit == conv


def test_truncation_is_counted(tmp_path):
    """--seq 8: each prompt keeps its last tokens (room for the longer completion, at least one),
    each completion its first; every cut is counted."""
    d, tok = hf_tok_dir(tmp_path, "smollm2")
    long = [{"prompt": "one two three four five six seven eight", "chosen": " a b c", "rejected": " d e f g h i j k l"}]
    write_jsonl(tmp_path / "long.jsonl", long)
    p = prepare(d / "tokenizer.json", tmp_path / "long.jsonl", tmp_path / "t", "--seq", "8")
    assert p.returncode == 0, p.stderr
    (pr, c, r), = [ids(q) for q in shards.read_pair_shard(str(tmp_path / "t_train.bin"))[0]]
    full_p = tok.encode(long[0]["prompt"], add_special_tokens=False).ids
    full_r = tok.encode(long[0]["rejected"], add_special_tokens=False).ids
    assert len(pr) == 1 and pr == full_p[-1:]  # the rejected completion fills the rest: the prompt keeps one token
    assert len(pr) + len(r) == 8 and r == full_r[:7]
    assert "1 prompts cut, 1 completions cut, 0 pairs skipped" in p.stdout, p.stdout


def test_refusals(tmp_path):
    d, _ = hf_tok_dir(tmp_path, "smollm2")
    write_jsonl(tmp_path / "mixed.jsonl", STANDARD + [{"prompt": "p", "response": "r"}])
    write_jsonl(tmp_path / "half.jsonl", [{"prompt": "p", "chosen": "c"}])
    write_jsonl(tmp_path / "conv.jsonl", CONV)
    for name, needle in (("mixed", "mixes preference records"), ("half", "needs both"), ("conv", "chat template")):
        p = prepare(d / "tokenizer.json", tmp_path / f"{name}.jsonl", tmp_path / name)
        assert p.returncode != 0 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not os.path.exists(tmp_path / f"{name}_train.bin")
