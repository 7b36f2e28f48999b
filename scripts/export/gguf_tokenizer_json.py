"""scripts/export/gguf_tokenizer_json.py: the Hugging Face tokenizer.json and tokenizer_config.json
of a GGUF's byte-level BPE tokenizer, as the hub ships them beside model.safetensors, built with
the `tokenizers` library from the GGUF's vocabulary and merges.

    python3 scripts/export/gguf_tokenizer_json.py --gguf MODEL.gguf --out DIR

tokenizer.json: BPE over the GGUF's tokens and merges, its control tokens added as special
tokens, the pre-tokenizer its tokenizer.ggml.pre names (smollm/starcoder: Digits then GPT-2's
ByteLevel regex; gpt-2: ByteLevel alone), the ByteLevel decoder. tokenizer_config.json: the chat
template and the BOS and EOS token strings. Only byte-level (tokenizer.ggml.model "gpt2") GGUFs
with one of those pre-tokenizers are supported; others are refused in one line. Together with
export_llama.py's config.json and model.safetensors this makes a directory as downloaded from
the hub (scripts/demo/chat_walkthrough.sh). A directory holding a tokenizer.bin is refused: the
trainer reads tokenizer.bin first (llmc/text/model_tokenizer.h), so the tokenizer.json would go unused.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "formats"))
import gguf_llama  # noqa: E402

PRE_DIGITS = {"smollm": True, "starcoder": True, "gpt-2": False}


def build(path):
    """(tokenizers.Tokenizer, tokenizer_config dict) of the GGUF at path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    gguf = gguf_llama.import_gguf()
    meta = gguf_llama.read_metadata(gguf.GGUFReader(path))
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt-2")
    if model != "gpt2" or pre not in PRE_DIGITS:
        raise gguf_llama.GGUFError(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r}; only byte-level BPE "
                                   f"(gpt2) with the pre-tokenizers {sorted(PRE_DIGITS)} is written as tokenizer.json")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == gguf_llama.TOKEN_CONTROL])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if PRE_DIGITS[pre] else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    bos, eos = int(meta.get("tokenizer.ggml.bos_token_id", 1)), int(meta.get("tokenizer.ggml.eos_token_id", 2))
    config = {"bos_token": tokens[bos], "eos_token": tokens[eos],
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="a GGUF file with a byte-level BPE tokenizer")
    ap.add_argument("--out", required=True, help="directory to write tokenizer.json and tokenizer_config.json into")
    args = ap.parse_args(argv)
    try:
        stale = os.path.join(args.out, "tokenizer.bin")
        if os.path.lexists(stale):
            raise OSError(f"{stale}: the trainer reads tokenizer.bin before tokenizer.json "
                          "(llmc/text/model_tokenizer.h), so the tokenizer.json written here would go unused; "
                          "remove it, or give another --out")
        tok, config = build(args.gguf)
        os.makedirs(args.out, exist_ok=True)
        tok_path, cfg_path = os.path.join(args.out, "tokenizer.json"), os.path.join(args.out, "tokenizer_config.json")
        tok.save(tok_path + ".tmp")  # written whole, then renamed into place
        with open(cfg_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        os.replace(tok_path + ".tmp", tok_path)
        os.replace(cfg_path + ".tmp", cfg_path)
    except (gguf_llama.GGUFError, OSError, KeyError) as e:
        print(f"gguf_tokenizer_json: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/tokenizer.json ({tok.get_vocab_size()} tokens) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
