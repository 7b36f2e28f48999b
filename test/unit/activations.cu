// test/unit/activations.cu: the 2-bit codes of the approximate activations (packing, ReSiLU2 and
// ReGELU2 backward against the step rule written out longhand, the exact forwards).
#include "unit.h"
#include "../../llmc/cpu/activations.h"

// ---- 2-bit codes ---------------------------------------------------------------------------

void test_pack_roundtrip(void) {
    Rng r = rng_seeded(1, 0);
    int sizes[] = {1, 2, 3, 4, 5, 7, 8, 13, 1001, 4099};
    int ok = 1;
    Relu3Fit fit = RESILU2_FIT;
    for (int s = 0; s < 10; s++) {
        int n = sizes[s];
        float* x = randn(n, &r, 5.0f);
        x[0] = fit.c1; if (n > 1) x[1] = fit.c2; if (n > 2) x[2] = fit.c3;  // ties: strict >
        int64_t nb = packed_codes_bytes(n);
        uint8_t* packed = (uint8_t*)xmalloc(nb + 1);
        packed[nb] = 0xAB;  // a canary past the end
        for (int64_t i = 0; i < n; i += 8) act_codes8(packed, i, n, act_load(x, i, n, -INFINITY), fit);  // as the forwards do
        for (int i = 0; i < n; i++) {
            int expect = (x[i] > fit.c1 ? 1 : 0) + (x[i] > fit.c2 ? 1 : 0) + (x[i] > fit.c3 ? 1 : 0);
            if (codes_get(packed, i) != expect) ok = 0;
        }
        if ((n % 4) && (packed[nb - 1] >> (2 * (n % 4))) != 0) ok = 0;  // ragged tail padded with zeros
        if (packed[nb] != 0xAB) ok = 0;
        if (nb != (n + 3) / 4) ok = 0;
        free(x); free(packed);
    }
    check(ok, "2-bit packing round-trips at ragged sizes (1..4099), ties strict", 0);
}

// The step rule, written out independently: dx = dy * {0, a1, a1+a2, a1+a2+a3}[code].
static double step_level(double x, const double a[3], const double c[3]) {
    float l1 = (float)a[0], l2 = l1 + (float)a[1], l3 = l2 + (float)a[2];
    if (x > c[2]) return l3;
    if (x > c[1]) return l2;
    if (x > c[0]) return l1;
    return 0.0;
}

void test_resilu2_backward(void) {
    const double a[3] = {-0.04060357190528599, 1.080925428529668, -0.040321856624382146};
    const double c[3] = {-6.3050461001646445, -0.0008684942046214787, 6.325815242089708};
    Rng r = rng_seeded(2, 0);
    int n = 10007;
    float *g = randn(n, &r, 6.0f), *u = randn(n, &r, 1.0f), *dp = randn(n, &r, 1.0f);
    float *p = randn(n, &r, 1), *sg = randn(n, &r, 1), *dg = randn(n, &r, 1), *du = randn(n, &r, 1);
    uint8_t* codes = (uint8_t*)xmalloc(packed_codes_bytes(n));
    swiglu_forward(p, sg, codes, g, u, n);
    swiglu_backward(dg, du, dp, sg, u, NULL, codes, n);
    int exact = 1;
    double fwd = 0;
    for (int i = 0; i < n; i++) {
        float expect_dg = dp[i] * u[i] * (float)step_level(g[i], a, c);
        if (dg[i] != expect_dg) exact = 0;
        if (du[i] != dp[i] * sg[i]) exact = 0;
        double silu = g[i] / (1.0 + exp(-(double)g[i]));
        fwd = fmax(fwd, fabs(sg[i] - silu) / fmax(1.0, fabs(silu)));
    }
    check(exact, "ReSiLU2 backward equals the step rule exactly", 0);
    check(fwd < 1e-6, "ReSiLU2 forward is the exact SiLU", fwd);
    // The levels of the fit, against docs/architecture.md: {0, -0.040603572, 1.0403218, 1.0}
    Relu3Fit fit = RESILU2_FIT;
    double le = fmax(fabs(relu3_level(1, fit) + 0.040603572), fmax(fabs(relu3_level(2, fit) - 1.0403218), fabs(relu3_level(3, fit) - 1.0)));
    check(le < 1e-6, "ReSiLU2 levels match the published levels", le);
    Relu3Fit gf = REGELU2_FIT;
    le = fmax(fabs(relu3_level(1, gf) + 0.049222611), fmax(fabs(relu3_level(2, gf) - 1.0487406), fabs(relu3_level(3, gf) - 1.0)));
    check(le < 1e-6, "ReGELU2 levels match the published levels", le);
    free(g); free(u); free(dp); free(p); free(sg); free(dg); free(du); free(codes);
}

void test_regelu2_backward(void) {
    const double a[3] = {-0.04922261145617846, 1.0979632065417297, -0.048740595085551286};
    const double c[3] = {-3.1858810036855245, -0.001178821281161997, 3.190832613414926};
    Rng r = rng_seeded(3, 0);
    int n = 5003;
    float *x = randn(n, &r, 3.0f), *dy = randn(n, &r, 1.0f), *y = randn(n, &r, 1), *dx = randn(n, &r, 1), *dxe = randn(n, &r, 1);
    uint8_t* codes = (uint8_t*)xmalloc(packed_codes_bytes(n));
    gelu_forward(y, codes, x, n, 0);
    gelu_backward(dx, dy, NULL, codes, n, 0);
    gelu_backward(dxe, dy, x, NULL, n, 0);
    int exact = 1;
    double fwd = 0, ge = 0;
    for (int i = 0; i < n; i++) {
        if (dx[i] != dy[i] * (float)step_level(x[i], a, c)) exact = 0;
        double ref = 0.5 * x[i] * (1.0 + erf(x[i] / sqrt(2.0)));
        fwd = fmax(fwd, fabs(y[i] - ref));
        double h = 1e-3, num = (0.5 * (x[i] + h) * (1 + erf((x[i] + h) / sqrt(2.0))) - 0.5 * (x[i] - h) * (1 + erf((x[i] - h) / sqrt(2.0)))) / (2 * h);
        ge = fmax(ge, fabs(dxe[i] - dy[i] * num));
    }
    check(exact, "ReGELU2 backward equals the step rule exactly", 0);
    check(fwd < 1e-5, "GELU forward (erf form) is exact", fwd);
    check(ge < 1e-4, "exact GELU backward matches finite differences", ge);
    free(x); free(dy); free(y); free(dx); free(dxe); free(codes);
}
