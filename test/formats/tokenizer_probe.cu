// tokenizer_probe: llmc/text/tokenizer.h and llmc/text/model_tokenizer.h from the command line, for
// test/formats/test_gguf_export.py and test/formats/test_hf_tokenizer.py.
//   tokenizer_probe TOKENIZER.bin info          vocab bos eos add_bos byte_level n_special
//   tokenizer_probe TOKENIZER.bin encode TEXT   the ids (with BOS as --generate asks for it)
//   tokenizer_probe TOKENIZER.bin decode ID...  the decoded bytes, each token given the
//                                               previous one as --generate does
// With a model directory instead (its tokenizer.bin, else its tokenizer.json, as --generate
// picks; vocabulary size taken from the tokenizer):
//   tokenizer_probe DIR info                    kind (bin|hf) bos, then the ids ending generation
//   tokenizer_probe DIR encode TEXT             the ids --generate feeds for the prompt TEXT
//   tokenizer_probe DIR encode-plain TEXT       tokenizer.json only: the ids without the
//                                               post-processor's tokens
//   tokenizer_probe DIR decode ID...            as above
//   tokenizer_probe DIR check-prompt W TEXT     model_tokenizer_check_prompt: TEXT as --prompt in a
//                                               window of W tokens ("ok", or fails in one line)
//   tokenizer_probe DIR encode-each FILE        encode-plain for each NUL-terminated text of FILE,
//                                               one line of ids each (one load for many texts)
//   tokenizer_probe --nfc FILE                  the NFC form of FILE's text (llmc/text/unicode_nfc.h)
//   tokenizer_probe --chat FILE                 FILE: JSON {"template", "messages": [{"role",
//                                               "content"}], "add_generation_prompt", "bos_token",
//                                               "eos_token"}; prints the rendering
//                                               (llmc/text/chat_template.h), or fails in one line
#include "../../llmc/text/model_tokenizer.h"
#include "../../llmc/text/chat_template.h"

static void print_ids(const int* ids, int n) {
    for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
}

static int probe_dir(int argc, char** argv) {
    int vocab = 1 << 30;  // a tokenizer.json's ids are checked against it; a tokenizer.bin's count must equal it
    char* bin = path_join(argv[1], "tokenizer.bin");
    if (optional_file_exists(bin)) {
        Tokenizer b;
        tokenizer_load(&b, bin, 0);
        vocab = b.vocab_size;
        tokenizer_free(&b);
    }
    free(bin);
    ModelTokenizer t;
    model_tokenizer_load(&t, argv[1], vocab, -1);
    if (strcmp(argv[2], "info") == 0) {
        printf("%s %d", t.is_hf ? "hf" : "bin", t.bos_id);
        for (int k = 0; k < t.n_end; k++) printf(" %d", t.end_ids[k]);
        printf("\n");
    } else if (strcmp(argv[2], "encode") == 0 && argc == 4) {
        int n, *ids = model_tokenizer_encode(&t, argv[3], &n);
        print_ids(ids, n);
        free(ids);
    } else if (strcmp(argv[2], "encode-plain") == 0 && argc == 4 && t.is_hf) {
        int n, *ids = hf_encode(&t.hf, argv[3], 0, &n);
        print_ids(ids, n);
        free(ids);
    } else if (strcmp(argv[2], "encode-each") == 0 && argc == 4 && t.is_hf) {
        size_t size;
        char* texts = read_file(argv[3], &size);
        for (size_t at = 0; at < size; at += strlen(texts + at) + 1) {
            int n, *ids = hf_encode(&t.hf, texts + at, 0, &n);
            print_ids(ids, n);
            free(ids);
        }
        free(texts);
    } else if (strcmp(argv[2], "check-prompt") == 0 && argc == 5) {
        model_tokenizer_check_prompt(&t, argv[4], 0, atoi(argv[3]), "--seq");
        printf("ok\n");
    } else if (strcmp(argv[2], "decode") == 0) {
        char bb[2];
        for (int i = 3, prev = -1; i < argc; prev = atoi(argv[i++]))
            fputs(model_tokenizer_decode(&t, prev, atoi(argv[i]), bb), stdout);
    } else {
        fail("tokenizer_probe: unknown command %s", argv[2]);
    }
    model_tokenizer_free(&t);
    return 0;
}

static int probe_nfc(const char* path) {
    size_t size, n;
    char* text = read_file(path, &size);
    char* norm = hf_nfc(text, size, &n);
    fwrite(norm, 1, n, stdout);
    free(norm);
    free(text);
    return 0;
}

static int probe_chat(const char* path) {
    size_t size;
    char* text = read_file(path, &size);
    Json j = json_parse(text, size, path);
    const Json* msgs = json_get(&j, "messages");
    int n = msgs ? msgs->count : 0;
    ChatMsg* m = (ChatMsg*)xcalloc(n + 1, sizeof(ChatMsg));
    for (int i = 0; i < n; i++) {
        m[i].role = json_string_or(&msgs->items[i], "role", "");
        m[i].content = json_string_or(&msgs->items[i], "content", "");
    }
    char* out = chat_template_render(json_string_or(&j, "template", ""), "template", m, n,
                                     json_bool_or(&j, "add_generation_prompt", 0), json_string_or(&j, "bos_token", ""),
                                     json_string_or(&j, "eos_token", ""));
    fputs(out, stdout);
    free(out);
    free(m);
    json_free(&j);
    free(text);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 3 && strcmp(argv[1], "--nfc") == 0) return probe_nfc(argv[2]);
    if (argc == 3 && strcmp(argv[1], "--chat") == 0) return probe_chat(argv[2]);
    if (argc < 3)
        fail("usage: tokenizer_probe TOKENIZER.bin|DIR info | encode TEXT | encode-plain TEXT | decode ID...");
    if (dir_exists(argv[1])) return probe_dir(argc, argv);
    Tokenizer t;
    tokenizer_load(&t, argv[1], 0);
    if (strcmp(argv[2], "info") == 0) {
        printf("%d %d %d %d %d %d\n", t.vocab_size, t.bos_id, t.eos_id, t.add_bos, t.byte_level, t.n_special);
    } else if (strcmp(argv[2], "encode") == 0 && argc == 4) {
        int* ids = (int*)xmalloc(sizeof(int) * (strlen(argv[3]) + 3));
        int n = tokenizer_encode(&t, argv[3], 1, ids);
        print_ids(ids, n);
        free(ids);
    } else if (strcmp(argv[2], "decode") == 0) {
        char bb[2];
        int prev = -1;
        for (int i = 3; i < argc; i++) {
            int id = atoi(argv[i]);
            fputs(tokenizer_decode(&t, prev, id, bb), stdout);
            prev = id;
        }
    } else {
        fail("tokenizer_probe: unknown command %s", argv[2]);
    }
    tokenizer_free(&t);
    return 0;
}
