// test/unit/vec_math.cu: the vector math of the CPU kernels in ulps against double precision:
// exp, erf and the GELUs with their derivatives, edge values included.
#include "unit.h"
#include "../../llmc/cpu/activations.h"

// ---- exp -----------------------------------------------------------------------------------

// vx_exp (llmc/cpu/vec_exp.h) against libm's double exp over the range the softmaxes use,
// [-87.3, 0], and a little above: within 4 ulp relative (the header claims about 2); 0 below -87.3.
void test_vec_exp(void) {
    double worst = 0;
    for (int i = 0; i <= 400000; i++) {
        float x = -87.3f + 95.0f * i / 400000.0f;
        if (x > 8.0f) break;
        float y = vx_exp(vx_splat(x))[0];
        double ref = exp((double)x);
        worst = fmax(worst, fabs(y - ref) / ref / 0x1p-23);
    }
    check(worst <= 4.0, "vx_exp within 4 ulp of exp on [-87.3, 8] (worst in ulp)", worst);
    check(vx_exp(vx_splat(-100.0f))[0] == 0.0f && vx_exp(vx_splat(-88.0f))[0] == 0.0f, "vx_exp gives 0 below -87.3", 0);
}

// ---- erf, GELU ------------------------------------------------------------------------------

// The fp32 ulp at |d|: 2^(e-24) for |d| in [2^(e-1), 2^e), 2^-149 among the denormals.
static double ulp_f32(double d) {
    int e;
    frexp(d, &e);
    return ldexp(1.0, (e < -125 ? -125 : e) - 24);
}
static float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// vx_erf (llmc/cpu/vec_exp.h) against double erf, in ulps of the result: every 2^8-th float of
// both signs (2^23 per sign, zero to inf), every float within 2^12 of the boundaries of its pieces
// (1, 3.9375), and the edge values. Bound 2: the fitted pieces are 1e-9 relative and 7e-9 absolute
// (beside results of at least 0.84), so what remains is fp32 rounding: half an ulp at the end, a
// fraction of one from a^2 and the polynomial's steps (1 - erfc keeps erfc's error below 0.16 of
// the result's). It reaches 1.12 here, as over every float of [2^-25, 4.5); libm's erff 0.92.
void test_vec_erf(void) {
    double worst = 0, worst_at = 0, lworst = 0;
    float xs[8];
    int k = 0, ok = 1;
    auto flush = [&](int m) {
        vx_f8 y = vx_erf(vx_load(xs));
        for (int j = 0; j < m; j++) {
            double ref = erf((double)xs[j]);
            double e = isnan(y[j]) ? INFINITY : fabs(y[j] - ref) / ulp_f32(ref);  // no NaN input in the sweep
            if (e > worst) { worst = e; worst_at = xs[j]; }
            lworst = fmax(lworst, fabs(erff(xs[j]) - ref) / ulp_f32(ref));
        }
    };
    auto add = [&](float x) { xs[k++] = x; if (k == 8) { flush(8); k = 0; } };
    for (uint32_t sg = 0; sg < 2; sg++) {
        for (uint32_t u = 0; u < 0x7f800000u; u += 256) add(f32_of_bits(u | sg << 31));
        const float bounds[2] = {1.0f, 3.9375f}, edges[5] = {1.4e-45f, 1.1754942e-38f, 1.1754944e-38f, 1e-30f, 3.4028235e38f};
        for (float b : bounds)
            for (int d = -4096; d <= 4096; d++) {
                uint32_t u;
                memcpy(&u, &b, 4);
                add(f32_of_bits((u + d) | sg << 31));
            }
        for (float x : edges) add(sg ? -x : x);
    }
    if (k) flush(k);
    char name[128];
    snprintf(name, sizeof(name), "vx_erf within 2 ulp of erf over fp32 (worst at %.9g; erff's %.2f)", worst_at, lworst);
    check(worst <= 2.0, name, worst);
    vx_f8 e = vx_erf((vx_f8){0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 3.4028235e38f, -1.4e-45f});
    ok = e[0] == 0.0f && !signbit(e[0]) && e[1] == 0.0f && signbit(e[1]) && e[2] == 1.0f && e[3] == -1.0f &&
         isnan(e[4]) && isnan(e[5]) && e[6] == 1.0f && e[7] < 0.0f && e[7] == (float)(-1.4e-45 * 1.1283791670955126);
    check(ok, "vx_erf edges: +-0 keep their sign, +-inf -> +-1, NaN -> NaN, denormals", 0);
}

// The vector GELUs (llmc/cpu/activations.h) against double references, every 2^10-th finite float
// of both signs (2^21 per sign). The forwards in ulps of max(|gelu(x)|, |x|/2): ulp of the result
// for x >= 0; for x < 0 the erf form's 1 + erf(x/sqrt 2) cancels, as gelu_f's does, leaving an
// error of a few ulp of 1 times |x|/2 (the tanh form forms 1 / (1 + e^(-2u)) and does not
// cancel). The derivatives in ulps of max(|gelu'(x)|, 1/2), i.e. units of 2^-24 below 1: they
// subtract x phi(x) from Phi(x) for x < 0, and x^2's rounding (relative 2^-24 x^2/2 in e^(-x^2/2))
// is there too. Reached here: 1.51, 1.52, 2.36, 2.35 (libm's scalar gelu_f and friends, the same
// formulas with erff/tanhf/expf, printed alongside: 1.51, 1.75, 2.24, 9.14). Bounds: 3, 3, 5, 5, about
// twice that, so a change of rounding order passes and a wrong coefficient or piece does not.
void test_vec_gelu(void) {
    const double k = sqrt(2.0 / M_PI), c = 0.044715;
    double w[4] = {0, 0, 0, 0}, l[4] = {0, 0, 0, 0};
    float xs[8];
    int n = 0;
    auto flush = [&](int m) {
        vx_f8 x = vx_load(xs), v[4] = {vx_gelu(x), vx_gelu_grad(x), vx_gelu_tanh(x), vx_gelu_tanh_grad(x)};
        for (int j = 0; j < m; j++) {
            double xd = xs[j], phi = exp(-0.5 * xd * xd) / sqrt(2.0 * M_PI), big = 0.5 * fabs(xd);
            double u = k * (xd + c * xd * xd * xd), e = exp(-2.0 * u), s = 1.0 / (1.0 + e);
            double ref[4] = {0.5 * xd * erfc(-xd / sqrt(2.0)), 0.5 * erfc(-xd / sqrt(2.0)) + xd * phi, xd * s,
                             isinf(e) ? 0.0 : s + 2.0 * xd * s * (e * s) * k * (1.0 + 3.0 * c * xd * xd)};
            float lib[4] = {gelu_f(xs[j]), gelu_grad_f(xs[j]), gelu_tanh_f(xs[j]), gelu_tanh_grad_f(xs[j])};
            for (int f = 0; f < 4; f++) {
                double unit = ulp_f32(fmax(fabs(ref[f]), f % 2 ? 0.5 : big));
                w[f] = fmax(w[f], isnan(v[f][j]) ? INFINITY : fabs(v[f][j] - ref[f]) / unit);
                if (!isnan(lib[f])) l[f] = fmax(l[f], fabs(lib[f] - ref[f]) / unit);
            }
        }
    };
    for (uint32_t sg = 0; sg < 2; sg++)
        for (uint32_t u = 0; u < 0x7f800000u; u += 1024) {
            xs[n++] = f32_of_bits(u | sg << 31);
            if (n == 8) { flush(8); n = 0; }
        }
    const char* what[4] = {"gelu (erf form)", "gelu' (erf form)", "gelu (tanh form)", "gelu' (tanh form)"};
    const double bound[4] = {3, 3, 5, 5};
    for (int f = 0; f < 4; f++) {
        char name[128];
        snprintf(name, sizeof(name), "vector %s within %g ulp of double (libm's: %.2f)", what[f], bound[f], l[f]);
        check(w[f] <= bound[f], name, w[f]);
    }
    vx_f8 x = (vx_f8){INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e30f, -1e30f, 3.0f};
    vx_f8 g = vx_gelu_grad(x), t = vx_gelu_tanh(x), tg = vx_gelu_tanh_grad(x), y = vx_gelu(x);
    int ok = y[0] == INFINITY && isnan(y[2]) && y[3] == 0.0f && y[5] == 1e30f && y[6] == 0.0f;
    ok = ok && g[0] == 1.0f && g[1] == 0.0f && isnan(g[2]) && g[3] == 0.5f && g[5] == 1.0f && g[6] == 0.0f;
    ok = ok && t[0] == INFINITY && t[1] == 0.0f && isnan(t[2]) && t[3] == 0.0f && t[5] == 1e30f && t[6] == 0.0f;
    ok = ok && tg[0] == 1.0f && tg[1] == 0.0f && isnan(tg[2]) && tg[3] == 0.5f && tg[5] == 1.0f && tg[6] == 0.0f;
    check(ok, "vector GELUs at +-inf, NaN, +-0, +-1e30: the limits, NaN kept", 0);
}
