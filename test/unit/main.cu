// test/unit/main.cu: unit tests of the CPU kernels and formats against independent references:
// naive loops in double precision, explicit Jacobians, finite differences, and the paper's
// step rule written out longhand, one file per concern beside this one (unit.h lists them).
// Prints one line per check, then "N passed, M failed", and exits non-zero on any failure.
#include "unit.h"

int g_pass = 0, g_fail = 0;

void check(int ok, const char* what, double err) {
    if (ok) g_pass++;
    else g_fail++;
    printf("%s  %-62s (worst error %.3g)\n", ok ? "PASS" : "FAIL", what, err);
}

int main(void) {
    test_pack_roundtrip();
    test_resilu2_backward();
    test_regelu2_backward();
    test_norm_backward(0);
    test_norm_backward(1);
    test_norm_huge_rows(0);
    test_norm_huge_rows(1);
    test_matmul();
    test_matmul_shapes();
    test_attention_blocks();
    test_vec_exp();
    test_vec_erf();
    test_vec_gelu();
    test_attention(1);
    test_attention(0);
    test_attention(2);
    test_attention(3);
    test_rope();
    test_chunked_loss();
    test_safetensors_roundtrip();
    test_crc32();
    test_json();
    test_grad_buckets();
    test_plan_alignment();
    test_lora_dropout(0.1f);
    test_lora_dropout(0.5f);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
