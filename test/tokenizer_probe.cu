// tokenizer_probe: llmc/tokenizer.h from the command line, for test/test_gguf_export.py.
//   tokenizer_probe TOKENIZER.bin info              vocab bos eos add_bos byte_level n_special
//   tokenizer_probe TOKENIZER.bin encode TEXT       the ids (with BOS as --generate asks for it)
//   tokenizer_probe TOKENIZER.bin decode ID...      the decoded bytes, each token given the
//                                                   previous one as --generate does
#include "../llmc/tokenizer.h"

int main(int argc, char** argv) {
    if (argc < 3) fail("usage: tokenizer_probe TOKENIZER.bin info | encode TEXT | decode ID...");
    Tokenizer t;
    tokenizer_load(&t, argv[1], 0);
    if (strcmp(argv[2], "info") == 0) {
        printf("%d %d %d %d %d %d\n", t.vocab_size, t.bos_id, t.eos_id, t.add_bos, t.byte_level, t.n_special);
    } else if (strcmp(argv[2], "encode") == 0 && argc == 4) {
        int* ids = (int*)xmalloc(sizeof(int) * (strlen(argv[3]) + 3));
        int n = tokenizer_encode(&t, argv[3], 1, ids);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
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
