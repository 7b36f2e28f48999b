// test/model/nf4_probe.cu: quantizes the fp32 tensor "w" of a safetensors file with llmc/nf4.h and writes
// what the format holds, for comparison with the NumPy reference (test/model/nf4_reference.py,
// test/model/test_nf4.py): "codes" (packed, U8), "qabsmax" (U8), "nested" (F32), "offset" (F32 [1]), the
// dequantized weights "dequant" (F32) and the tables "tables" (F32: NF4's 16 values, the dynamic map).
#include "../../llmc/common.h"
#include "../../llmc/formats/safetensors.h"
#include "../../llmc/nf4.h"

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: nf4_probe IN.safetensors OUT.safetensors (IN holds an F32 tensor \"w\")");
    StFile in;
    st_open(&in, argv[1]);
    const StTensor* t = st_find(&in, "w");
    if (!t || t->dtype != ST_F32) fail("%s: expected an F32 tensor \"w\"", argv[1]);
    int64_t n = st_numel(t);
    float* w = (float*)xmalloc(sizeof(float) * (n ? n : 1));
    st_to_f32(t, w);
    float tables[NF4_TABLE_FLOATS];
    nf4_fill_tables(tables);
    void* buf = xcalloc(1, (size_t)nf4_tensor_bytes(n));
    float* absmax = (float*)xmalloc(sizeof(float) * nf4_blocks(n));
    Nf4View q = nf4_view(buf, n);
    nf4_quantize(q, w, tables, absmax);
    float* deq = (float*)xmalloc(sizeof(float) * n);
    nf4_dequantize(deq, q, tables);
    StWriter wr;
    memset(&wr, 0, sizeof(wr));
    int64_t n2 = (n + 1) / 2, one = 1, nt = NF4_TABLE_FLOATS;
    st_writer_add(&wr, "codes", ST_U8, 1, &n2, q.codes);
    st_writer_add(&wr, "qabsmax", ST_U8, 1, &q.nb, q.qabsmax);
    st_writer_add(&wr, "nested", ST_F32, 1, &q.nn, q.nested);
    st_writer_add(&wr, "offset", ST_F32, 1, &one, q.offset);
    st_writer_add(&wr, "dequant", ST_F32, 1, &n, deq);
    st_writer_add(&wr, "tables", ST_F32, 1, &nt, tables);
    st_writer_save(&wr, argv[2], NULL);
    st_writer_free(&wr);
    st_close(&in);
    free(w); free(buf); free(absmax); free(deq);
    printf("nf4_probe: %lld weights, %lld bytes\n", (long long)n, (long long)nf4_tensor_bytes(n));
    return 0;
}
