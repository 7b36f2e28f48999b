// attn_docs_probe: llmc/attn_docs.h on positions read from stdin, for test/cuda/test_attention_docs.py,
// which checks the arrays against documents found with numpy.
// stdin: "B T H KVH hd PAD" then B*T positions; PAD: entries of cuDNN's batch past the documents.
// stdout: "refused: WHY", or "docs D max_len L batch E" and the lines off_q, off_kv, off_stats
// (E+1 numbers each) and seq_len (E numbers).
#include <stdio.h>
#include <stdlib.h>
#include "../../llmc/attn_docs.h"

static void print_row(const char* name, const int64_t* v, int n) {
    printf("%s", name);
    for (int i = 0; i < n; i++) printf(" %lld", (long long)v[i]);
    printf("\n");
}

int main(void) {
    int B, T, H, KVH, hd, pad;
    if (scanf("%d %d %d %d %d %d", &B, &T, &H, &KVH, &hd, &pad) != 6 || B < 0 || T < 0 || pad < 0) {
        fprintf(stderr, "error: expected B T H KVH hd PAD and then B*T positions\n");
        return 1;
    }
    int64_t N = (int64_t)B * T;
    int* pos = (int*)malloc(sizeof(int) * (N + 1));
    for (int64_t i = 0; i < N; i++)
        if (scanf("%d", &pos[i]) != 1) {
            fprintf(stderr, "error: fewer than B*T positions\n");
            return 1;
        }
    int max_len = 0;
    const char* why = NULL;
    int docs = attn_docs_count(pos, B, T, &max_len, &why);
    if (docs < 0) {
        printf("refused: %s\n", why);
        return 0;
    }
    int batch = docs + pad;
    void* buf = malloc(attn_docs_bytes(batch));
    AttnDocArrays a = attn_docs_arrays(buf, batch);
    attn_docs_fill(a, pos, B, T, batch, H, KVH, hd);
    printf("docs %d max_len %d batch %d\n", docs, max_len, batch);
    print_row("off_q", a.off_q, batch + 1);
    print_row("off_kv", a.off_kv, batch + 1);
    print_row("off_stats", a.off_stats, batch + 1);
    printf("seq_len");
    for (int i = 0; i < batch; i++) printf(" %d", a.seq_len[i]);
    printf("\n");
    free(buf);
    free(pos);
    return 0;
}
