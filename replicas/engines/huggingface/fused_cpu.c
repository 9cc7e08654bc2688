/* A float32 Llama decoder's forward pass in one call, for a CPU core: fused_cpu.py builds this
 * file with the system's C compiler at replica start and calls `llama_forward` once a step.
 *
 * Why: on a CPU the eager forward of a small model spends more time in some 1,500 small ATen
 * operators a step (norms, RoPE, reshapes, attention set-up) than in its arithmetic; here a
 * layer is a few loops over the tokens, and every weight is read once a step whatever the
 * number of tokens.
 *
 * Batch invariance by construction: every number a token computes (its norms, projections,
 * attention over its own slot, MLP) is summed in an order that depends only on the model's
 * shapes, never on how many tokens, rows or keys the call has. So a verify of k + 1 positions
 * gives bitwise the logits the single steps of the target alone give, in any batch.
 *
 * Shapes: T tokens, hidden H, intermediate I, NH query heads and KVH key/value heads of
 * head_dim D, QKV = (NH + 2 KVH) D. A token t is written at position pos[t] of cache slot
 * slot[t] and attends to positions 0..pos[t] of that slot; slot 0 is scratch (padding and
 * holes): such tokens are skipped and their hidden states set to zero.
 *
 * Weights are packed by fused_cpu.py into panels of PANEL output columns, [N / PANEL][K][PANEL]
 * (zero-padded), so the matmul streams each weight once per step, a panel at a time. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A vector is the CPU's widest register: GCC lowers a generic vector wider than the hardware's
 * into pairs of halves kept in memory, and an accumulator in memory costs a store and a load
 * on every weight row (measured 3x slower per token with 16-lane vectors on an AVX2 CPU). */
#ifdef __AVX512F__
#  define LANES 16
#else
#  define LANES 8
#endif
/* A matmul block accumulates TOKEN_BLOCK tokens x one panel row in registers while it streams
 * the panel's rows (k). 32 512-bit registers hold 4 tokens x 64 columns and the weights;
 * AVX2's 16 256-bit ones (a 16-lane vector is two of them) hold 4 tokens x 16 columns, and a
 * block that does not fit spills on every row (with 64 columns measured 2-3x slower per token
 * on an AVX2 CPU, docs/BENCHMARKS.md). fused_cpu.py packs the weights in panels of the
 * width this build reports (fused_panel_columns). Each output sums its products in k order
 * either way. */
#ifndef PANEL
#  ifdef __AVX512F__
#    define PANEL 64
#  else
#    define PANEL 16
#  endif
#endif
#define TOKEN_BLOCK 4

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float uvec __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* mask ? a : b, lane by lane (mask lanes all ones or all zeros, as comparisons give). */
static inline vec pick(ivec mask, vec a, vec b) {
    return (vec)((mask & (ivec)a) | (~mask & (ivec)b));
}

/* The lanes' sum as a tree: halves added until one lane is left (the same order either way). */
#if LANES == 8
static inline float lane_sum(vec v) {
    float a[4];
    for (int i = 0; i < 4; i++) a[i] = v[i] + v[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}
#else
static inline float lane_sum(vec v) {
#if defined(__clang__) || __GNUC__ >= 12
    typedef float half8 __attribute__((vector_size(8 * sizeof(float))));
    typedef float half4 __attribute__((vector_size(4 * sizeof(float))));
    half8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    half4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif

/* e^x lane by lane, x <= 88: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
 * polynomial (relative error under 2e-7, about libm's), times 2^n put into the exponent. */
static inline vec vexp(vec x) {
    const vec log2e = (vec){0} + 1.44269504088896341f, ln2_hi = (vec){0} + 0.693359375f,
              ln2_lo = (vec){0} + -2.12194440e-4f;
    const vec round = (vec){0} + 12582912.0f;  /* 1.5 2^23: adding it rounds to an integer */
    x = pick(x < -87.0f, (vec){0} - 87.0f, x); /* e^-87 is 1.6e-38: still a normal float */
    vec n = (x * log2e + round) - round;
    vec r = (x - n * ln2_hi) - n * ln2_lo;
    vec p = 1.0f / 720 + 0 * r;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* y[t, c] (+)= sum_k x[t, k] w[k, c], k ascending, for TB tokens and NB vectors of a panel. */
static inline __attribute__((always_inline)) void panel_block(
    const int TB, const int NB, int K, const float *x, int ldx, const float *panel,
    float *y, int ldy, int columns, int accumulate) {
    vec acc[TOKEN_BLOCK][PANEL / LANES];
    for (int t = 0; t < TB; t++)
        for (int n = 0; n < NB; n++) acc[t][n] = (vec){0};
    for (int k = 0; k < K; k++) {
        vec w[PANEL / LANES];
        for (int n = 0; n < NB; n++) w[n] = load(panel + (int64_t)k * PANEL + n * LANES);
        for (int t = 0; t < TB; t++) {
            float xs = x[(int64_t)t * ldx + k];
            for (int n = 0; n < NB; n++) acc[t][n] += xs * w[n];
        }
    }
    for (int t = 0; t < TB; t++) {
        float *row = y + (int64_t)t * ldy;
        for (int n = 0; n < NB; n++) {
            int lanes = columns - n * LANES < LANES ? columns - n * LANES : LANES;
            float part[LANES];
            store(part, acc[t][n]);
            for (int c = 0; c < lanes; c++)
                row[n * LANES + c] = accumulate ? row[n * LANES + c] + part[c] : part[c];
        }
    }
}

#define BLOCK_CASE(TB, NB) \
    case (TB) * 8 + (NB): panel_block(TB, NB, K, xb, ldx, panel, yb, ldy, columns, accumulate); break;
#define BLOCK_ROW(TB) BLOCK_CASE(TB, 1) BLOCK_CASE(TB, 2) BLOCK_CASE(TB, 3) BLOCK_CASE(TB, 4)

/* y[T, N] = x[T, K] W (accumulate: y += x W, the residual added to the rounded product). */
static void matmul(int T, int K, int N, const float *x, int ldx, const float *packed,
                   float *y, int ldy, int accumulate) {
    for (int j = 0; j < N; j += PANEL) {
        const float *panel = packed + (int64_t)(j / PANEL) * K * PANEL;
        int columns = N - j < PANEL ? N - j : PANEL;
        int vectors = (columns + LANES - 1) / LANES;
        for (int t0 = 0; t0 < T; t0 += TOKEN_BLOCK) {
            int tb = T - t0 < TOKEN_BLOCK ? T - t0 : TOKEN_BLOCK;
            const float *xb = x + (int64_t)t0 * ldx;
            float *yb = y + (int64_t)t0 * ldy + j;
            switch (tb * 8 + vectors) {
                BLOCK_ROW(1) BLOCK_ROW(2) BLOCK_ROW(3) BLOCK_ROW(4)
            }
        }
    }
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), transformers' LlamaRMSNorm in float32. */
static void rms_norm(int H, const float *x, const float *weight, float eps, float *out) {
    vec acc = {0};
    int i = 0;
    for (; i + LANES <= H; i += LANES) {
        vec v = load(x + i);
        acc += v * v;
    }
    float squares = lane_sum(acc);
    for (; i < H; i++) squares += x[i] * x[i];
    float inverse = 1.0f / sqrtf(squares / (float)H + eps);
    for (i = 0; i < H; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* x = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1). */
static void rope(int D, float *x, const float *cos, const float *sin) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline float dot(int D, const float *a, const float *b) {
    vec acc = {0};
    for (int i = 0; i < D; i += LANES) acc += load(a + i) * load(b + i);
    return lane_sum(acc);
}

/* out = sum_i weights[i] values[i] / total over i ascending, V vectors of D = V LANES at once. */
static inline __attribute__((always_inline)) void weighted_sum(
    const int V, int length, const float *weights, const float *values, float total, float *out) {
    vec acc[8];
    for (int v = 0; v < V; v++) acc[v] = (vec){0};
    for (int i = 0; i < length; i++)
        for (int v = 0; v < V; v++) acc[v] += weights[i] * load(values + (int64_t)i * V * LANES + v * LANES);
    for (int v = 0; v < V; v++) store(out + v * LANES, acc[v] / total);
}

/* out[D] = softmax(q . keys[0..length) * scale) values[0..length), keys/values [length, D];
 * scores: room for length rounded up to LANES. */
static void attend(int D, int length, const float *q, const float *keys, const float *values,
                   float scale, float *scores, float *out) {
    int padded = (length + LANES - 1) / LANES * LANES;
    float top = -INFINITY;
    for (int i = 0; i < length; i++) {
        scores[i] = dot(D, q, keys + (int64_t)i * D) * scale;
        top = scores[i] > top ? scores[i] : top;
    }
    for (int i = length; i < padded; i++) scores[i] = -INFINITY;
    vec sums = {0};
    for (int i = 0; i < padded; i += LANES) {
        vec e = vexp(load(scores + i) - top);
        e = pick(load(scores + i) == -INFINITY, (vec){0}, e);
        store(scores + i, e);
        sums += e;
    }
    float total = lane_sum(sums);
    switch (D / LANES) {
        case 1: weighted_sum(1, length, scores, values, total, out); break;
        case 2: weighted_sum(2, length, scores, values, total, out); break;
        case 4: weighted_sum(4, length, scores, values, total, out); break;
        case 8: weighted_sum(8, length, scores, values, total, out); break;
        case 16: weighted_sum(16, length, scores, values, total, out); break;
        default:
            for (int d = 0; d < D; d += LANES) {
                vec acc = {0};
                for (int i = 0; i < length; i++) acc += scores[i] * load(values + (int64_t)i * D + d);
                store(out + d, acc / total);
            }
    }
}

/* gate[i] = silu(gate[i]) up[i] = gate[i] / (1 + e^-gate[i]) up[i] */
static void silu_times(int I, float *gate, const float *up) {
    int i = 0;
    for (; i + LANES <= I; i += LANES) {
        vec g = load(gate + i), minus = (vec){0} - g;
        vec e = vexp(pick(minus < 87.0f, minus, (vec){0} + 87.0f));
        store(gate + i, g / (1.0f + e) * load(up + i));
    }
    for (; i < I; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

struct model {
    int layers, H, I, NH, KVH, D;
    float eps, scale;
    int64_t max_len;              /* positions per slot */
    const float *cos, *sin;       /* [max_len, D] */
    const float *const *weights;  /* per layer: input norm, packed QKV, packed O, post norm, packed gate|up, packed down */
    const float *final_norm;
};

enum { INPUT_NORM, QKV, O, POST_NORM, GATE_UP, DOWN, WEIGHTS_PER_LAYER };

/* hidden [T, H] in place: the decoder's output, final norm applied. keys/values: per layer a
 * [slots, KVH, max_len, D] tensor. work: (QKV + NH D + 2 I + 2 H) T + max_len + LANES floats.
 * Returns 0, or -1 where memory for the token index ran out (nothing computed). */
int llama_forward(const struct model *m, int T, float *hidden, const int64_t *slot, const int64_t *pos,
                   float *const *keys, float *const *values, float *work) {
    const int H = m->H, I = m->I, D = m->D, NH = m->NH, KVH = m->KVH;
    const int QKV_N = (NH + 2 * KVH) * D, groups = NH / KVH;
    int *real = malloc(sizeof(int) * (T > 0 ? T : 1));
    if (real == NULL) return -1;
    int R = 0;
    for (int t = 0; t < T; t++) {
        if (slot[t] != 0) real[R++] = t;
        else memset(hidden + (int64_t)t * H, 0, H * sizeof(float));
    }
    float *x = work;                            /* [R, H] the real tokens' hidden states */
    float *normed = x + (int64_t)R * H;         /* [R, H] */
    float *qkv = normed + (int64_t)R * H;       /* [R, QKV_N] */
    float *attended = qkv + (int64_t)R * QKV_N; /* [R, NH D] */
    float *gate_up = attended + (int64_t)R * NH * D; /* [R, 2 I] */
    float *scores = gate_up + (int64_t)R * 2 * I;    /* [max_len] */
    for (int r = 0; r < R; r++) memcpy(x + (int64_t)r * H, hidden + (int64_t)real[r] * H, H * sizeof(float));

    for (int layer = 0; layer < m->layers; layer++) {
        const float *const *w = m->weights + layer * WEIGHTS_PER_LAYER;
        for (int r = 0; r < R; r++) rms_norm(H, x + (int64_t)r * H, w[INPUT_NORM], m->eps, normed + (int64_t)r * H);
        matmul(R, H, QKV_N, normed, H, w[QKV], qkv, QKV_N, 0);
        for (int r = 0; r < R; r++) {           /* RoPE, then the cache write */
            int t = real[r];
            float *q = qkv + (int64_t)r * QKV_N, *k = q + NH * D, *v = k + KVH * D;
            const float *cos = m->cos + pos[t] * D, *sin = m->sin + pos[t] * D;
            for (int h = 0; h < NH; h++) rope(D, q + h * D, cos, sin);
            for (int h = 0; h < KVH; h++) {
                rope(D, k + h * D, cos, sin);
                int64_t at = ((slot[t] * KVH + h) * m->max_len + pos[t]) * D;
                memcpy(keys[layer] + at, k + h * D, D * sizeof(float));
                memcpy(values[layer] + at, v + h * D, D * sizeof(float));
            }
        }
        for (int r = 0; r < R; r++) {
            int t = real[r];
            const float *q = qkv + (int64_t)r * QKV_N;
            for (int h = 0; h < NH; h++) {
                int64_t base = (slot[t] * KVH + h / groups) * m->max_len * D;
                attend(D, (int)pos[t] + 1, q + h * D, keys[layer] + base, values[layer] + base, m->scale,
                       scores, attended + (int64_t)r * NH * D + h * D);
            }
        }
        matmul(R, NH * D, H, attended, NH * D, w[O], x, H, 1);
        for (int r = 0; r < R; r++) rms_norm(H, x + (int64_t)r * H, w[POST_NORM], m->eps, normed + (int64_t)r * H);
        matmul(R, H, 2 * I, normed, H, w[GATE_UP], gate_up, 2 * I, 0);
        for (int r = 0; r < R; r++) {           /* silu(gate) * up, into the gate half */
            float *g = gate_up + (int64_t)r * 2 * I;
            silu_times(I, g, g + I);
        }
        matmul(R, I, H, gate_up, 2 * I, w[DOWN], x, H, 1);
    }
    for (int r = 0; r < R; r++) rms_norm(H, x + (int64_t)r * H, m->final_norm, m->eps, hidden + (int64_t)real[r] * H);
    free(real);
    return 0;
}

/* The output columns a packed weight panel holds in this build. */
int fused_panel_columns(void) { return PANEL; }

/* y[T, N] = x[T, K] W, W packed as the layers' weights are: the output layer's logits. */
void project(int T, int K, int N, const float *x, const float *packed, float *y) {
    matmul(T, K, N, x, K, packed, y, N, 0);
}
