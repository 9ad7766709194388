// Batch-invariant causal attention for CPU, fp32: one fused pass over a query's own keys whose every
// rounding is fixed by the query and its keys alone (not by the number of queries, the tile a query
// falls in, the key length or the thread count). parallel/invariant.py's `inv_attention` uses it for
// both the KV-cache decode (one query per head) and the trainer's full forward, so the two give a token
// the same bits while a decode step reads its cache once (no four-row BLAS tile per query).
//
// Per query, over the keys it sees (position <= the query's, below `length`, valid):
//   s_j = the dot product of the scaled query and key j: one fma chain over the head dimension in index
//         order (vectorised across 16 keys, never across the head dimension);
//   m   = the max of the seen scores (exact in any order);
//   p_j = exp(s_j - m) by the fixed polynomial below (lane-wise: the same bits vectorised or not);
//   den = 16 lane sums (lane l: keys 16 i + l, in key order), then a fixed tree;
//   num = per block of 64 keys an fma chain over its seen keys in key order, the blocks added in order;
//   y   = num / den, lse = m + log(den).
// A query that sees no key gives y = 0, lse = +inf. Built with -ffp-contract=off: the only fused
// operations are the explicit fmaf calls, so a vectorised and a scalar copy of a loop round alike.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// exp(x) for x <= 0 (0 below -87.5, where exp is under 1e-38): 2^n P(r), r = x - n ln2 in [-ln2/2, ln2/2],
// P the degree-7 Taylor polynomial (relative error < 1e-8 before rounding); n rounded to nearest by the
// 1.5 * 2^23 shift (adds only: vectorises).
inline float exp_scalar(float x) {
  const float xc = x < -87.5f ? -87.5f : x;  // also maps -inf: the result is zeroed below
  const float shift = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + shift) - shift;
  float r = fmaf(n, -0.693145751953125f, xc);
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 5040.0f;
  p = fmaf(p, r, 1.0f / 720.0f);
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]: a normal power of two
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  const float y = p * two_n;
  return x < -87.5f ? 0.0f : y;
}

// the same steps on whole registers (each intrinsic the lane-wise operation above, exactly rounded alike:
// the max is `x < -87.5 ? -87.5 : x`, the float-to-int conversion exact on a whole n)
#define KLTRON_EXP_LANES(W, PS, SI, ZERO_BELOW)                                              \
  inline W exp_lanes(W x) {                                                                         \
    const W lo = PS(set1_ps)(-87.5f), shift = PS(set1_ps)(12582912.0f);                              \
    const W xc = PS(max_ps)(lo, x);                                                                 \
    const W n = PS(sub_ps)(PS(add_ps)(PS(mul_ps)(xc, PS(set1_ps)(1.44269504088896341f)), shift), shift); \
    W r = PS(fmadd_ps)(n, PS(set1_ps)(-0.693145751953125f), xc);                                    \
    r = PS(fmadd_ps)(n, PS(set1_ps)(-1.428606765330187045e-06f), r);                                \
    W p = PS(set1_ps)(1.0f / 5040.0f);                                                              \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f / 720.0f));                                             \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f / 120.0f));                                             \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f / 24.0f));                                              \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f / 6.0f));                                               \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(0.5f));                                                      \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f));                                                      \
    p = PS(fmadd_ps)(p, r, PS(set1_ps)(1.0f));                                                      \
    const W two_n = PS(castsi##SI##_ps)(PS(slli_epi32)(PS(add_epi32)(PS(cvttps_epi32)(n), PS(set1_epi32)(127)), 23)); \
    return ZERO_BELOW(PS(mul_ps)(p, two_n), x, lo);                                                 \
  }
#if defined(__AVX512F__)
#define KLTRON_PS512(op) _mm512_##op
inline __m512 zero_below_512(__m512 y, __m512 x, __m512 lo) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
}
KLTRON_EXP_LANES(__m512, KLTRON_PS512, 512, zero_below_512)
#elif defined(__AVX2__) && defined(__FMA__)
#define KLTRON_PS256(op) _mm256_##op
inline __m256 zero_below_256(__m256 y, __m256 x, __m256 lo) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
}
KLTRON_EXP_LANES(__m256, KLTRON_PS256, 256, zero_below_256)
#endif

// 16 fp32 lanes: one AVX-512 register, two AVX2 ones, or a plain array. Every operation is lane-wise (fma is
// the exactly rounded fused multiply-add on every path), so the three give the same bits.
struct V16 {
#if defined(__AVX512F__)
  __m512 a;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, a); }
  static V16 fma(V16 x, V16 y, V16 z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
  static V16 max(V16 x, V16 y) { return {_mm512_max_ps(x.a, y.a)}; }
  static V16 add(V16 x, V16 y) { return {_mm512_add_ps(x.a, y.a)}; }
  static V16 sub(V16 x, V16 y) { return {_mm512_sub_ps(x.a, y.a)}; }
  static V16 exp_nonpos(V16 x) { return {exp_lanes(x.a)}; }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a, b;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, a); _mm256_storeu_ps(p + 8, b); }
  static V16 fma(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static V16 max(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
  static V16 add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  static V16 sub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
  static V16 exp_nonpos(V16 x) { return {exp_lanes(x.a), exp_lanes(x.b)}; }
#else
  float a[16];
  static V16 zero() { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = 0.0f; return r; }
  static V16 set1(float x) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = x; return r; }
  static V16 load(const float* p) { V16 r; std::memcpy(r.a, p, sizeof(r.a)); return r; }
  void store(float* p) const { std::memcpy(p, a, sizeof(a)); }
  static V16 fma(V16 x, V16 y, V16 z) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = fmaf(x.a[i], y.a[i], z.a[i]); return r; }
  static V16 max(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = x.a[i] > y.a[i] ? x.a[i] : y.a[i]; return r; }
  static V16 add(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = x.a[i] + y.a[i]; return r; }
  static V16 sub(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = x.a[i] - y.a[i]; return r; }
  static V16 exp_nonpos(V16 x) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = exp_scalar(x.a[i]); return r; }
#endif
};

// a hint to fetch n floats from p (a key or value row a few rows ahead of the one read)
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

constexpr int64_t KL = 16;      // keys per score block (the vector lanes)
constexpr int64_t QT = 8;       // queries per tile (they share each key block's loads)
// how many of a tile's queries one pass of the score and value loops carries in registers: a query holds one
// V16 of scores and VG of weighted values. AVX-512 has 32 vector registers, AVX2 16 (8 queries would
// spill); the split sets only which loads are shared, not any rounding.
#if defined(__AVX512F__)
constexpr int SCORE_NT = 8, VALUE_NT = 8;
#else
constexpr int SCORE_NT = 4, VALUE_NT = 1;
#endif
constexpr int64_t DEC_BLOCKS = 4;  // key blocks a decode step's query scores at once
constexpr int64_t VBLOCK = 64;  // keys per partial sum of the weighted values
// head-dimension columns per pass of the weighted values, VG vectors of 16: a query's VG accumulator chains
// are independent, so more of them hide the fma latency (AVX2 carries one query per pass: 64 columns)
#if defined(__AVX512F__)
constexpr int VG = 2;
#else
constexpr int VG = 4;
#endif
constexpr int64_t VC = 16 * VG;

struct Args {
  const float *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];  // strides of dims 0..2 (the last dim is contiguous)
  const int64_t* pos;           // [B, R]
  const bool* valid;            // [B, L] or null
  float* y;                     // [B, H, R, D] contiguous
  float* lse;                   // [B, H, R] contiguous
  int64_t H, R, D, L, n;
  float scale;
};

struct Scratch {
  std::vector<float> q, kt, sc, p;
};

// keys kr [kn <= 16 rows, D] (row stride ks) -> dst [D, 16], rows past kn as zeros (pure data movement)
inline void transpose_keys(const float* kr, int64_t ks, int64_t kn, int64_t D, float* dst) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 16 <= D; d0 += 16) {
    __m512 r[16], t[16], u[16];
    for (int l = 0; l < 16; ++l) r[l] = l < kn ? _mm512_loadu_ps(kr + l * ks + d0) : _mm512_setzero_ps();
    if (kn == 16)  // the next block's rows, this chunk of columns
      for (int l = 0; l < 16; ++l) __builtin_prefetch(kr + (16 + l) * ks + d0);
    for (int i = 0; i < 8; ++i) {  // within 128-bit lanes: pairs of rows interleaved
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // u[4 i + c]: rows 4 i .. 4 i + 3 of column 4 L + c in lane L
      u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {  // gather the four row groups of columns c, 4 + c, 8 + c, 12 + c
      const __m512 a08 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);   // rows 0-7 of columns c, 8 + c
      const __m512 a412 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);  // rows 0-7 of columns 4 + c, 12 + c
      const __m512 b08 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
      const __m512 b412 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
      _mm512_storeu_ps(dst + (d0 + c) * KL, _mm512_shuffle_f32x4(a08, b08, 0x88));
      _mm512_storeu_ps(dst + (d0 + 8 + c) * KL, _mm512_shuffle_f32x4(a08, b08, 0xDD));
      _mm512_storeu_ps(dst + (d0 + 4 + c) * KL, _mm512_shuffle_f32x4(a412, b412, 0x88));
      _mm512_storeu_ps(dst + (d0 + 12 + c) * KL, _mm512_shuffle_f32x4(a412, b412, 0xDD));
    }
  }
#elif defined(__AVX2__)
  for (; d0 + 8 <= D; d0 += 8) {
    for (int g = 0; g < 2; ++g) {  // rows 8 g .. 8 g + 7 -> lanes 8 g .. 8 g + 7 of 8 columns
      __m256 r[8], t[8], u[8];
      for (int l = 0; l < 8; ++l)
        r[l] = 8 * g + l < kn ? _mm256_loadu_ps(kr + (8 * g + l) * ks + d0) : _mm256_setzero_ps();
      if (kn == 16)  // the next block's rows, this chunk of columns
        for (int l = 0; l < 8; ++l) __builtin_prefetch(kr + (16 + 8 * g + l) * ks + d0);
      for (int i = 0; i < 4; ++i) {  // within 128-bit lanes: pairs of rows interleaved
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {  // u[4 i + c]: rows 4 i .. 4 i + 3 of columns c (low half), 4 + c (high)
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(dst + (d0 + c) * KL + 8 * g, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
        _mm256_storeu_ps(dst + (d0 + 4 + c) * KL + 8 * g, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
      }
    }
  }
#endif
  for (int64_t l = 0; l < KL; ++l)
    for (int64_t d = d0; d < D; ++d) dst[d * KL + l] = l < kn ? kr[l * ks + d] : 0.0f;
}

// the scores of NT queries q [NT, D] against a block of 16 transposed keys kt [D, 16] (keys j0 .. j0 + 15):
// each (query, key) one fma chain over d in order (NT only sets how many chains share a key load)
template <int NT>
inline void score_block(const float* q, int64_t D, const float* kt, int64_t j0, float* out, int64_t out_ld) {
  V16 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = V16::zero();
  for (int64_t d = 0; d < D; ++d) {
    const V16 kd = V16::load(kt + d * KL);
    for (int t = 0; t < NT; ++t) acc[t] = V16::fma(V16::set1(q[t * D + d]), kd, acc[t]);
  }
  for (int t = 0; t < NT; ++t) acc[t].store(out + t * out_ld + j0);
}

// a decode step's scores: one query against NB blocks of 16 transposed keys kt [NB, D, 16] (keys j0 ..
// j0 + 16 NB - 1), each (query, key) the same fma chain over d as score_block's; the NB blocks' chains are
// independent, so they overlap (one block's chain alone waits on each fma's latency)
template <int NB>
inline void score_one_query(const float* q, int64_t D, const float* kt, int64_t j0, float* out) {
  V16 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = V16::zero();
  for (int64_t d = 0; d < D; ++d) {
    const V16 qd = V16::set1(q[d]);
    for (int b = 0; b < NB; ++b) acc[b] = V16::fma(qd, V16::load(kt + (b * D + d) * KL), acc[b]);
  }
  for (int b = 0; b < NB; ++b) acc[b].store(out + j0 + b * KL);
}

// the weighted values of keys j0 .. j1 - 1 (the valid ones, in order) for NT queries, columns c0 .. c0 + VC - 1:
// acc[t] = fma(p_t[j], v_j, acc[t]), one chain per query and column (NT only sets how many share a load)
template <int NT>
inline void value_chain(const float* vb, int64_t vstride, int64_t c0, int64_t D, int64_t j0, int64_t j1,
                        const bool* valid, const float* const* p, V16 (*acc)[VG]) {
  V16 r[NT][VG];
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < VG; ++g) r[t][g] = acc[t][g];
  const bool tail = D - c0 < VC;
  for (int64_t j = j0; j < j1; ++j) {
    if (valid != nullptr && !valid[j]) continue;
    const float* vr = vb + j * vstride + c0;
    prefetch(vr + 8 * vstride, VC);
    float buf[VC];
    if (tail) {  // a head dimension not a multiple of VC: the missing columns read as 0
      for (int64_t c = 0; c < VC; ++c) buf[c] = c < D - c0 ? vr[c] : 0.0f;
      vr = buf;
    }
    for (int t = 0; t < NT; ++t) {  // each value vector loaded by its fma (no registers held for them)
      const V16 pj = V16::set1(p[t][j]);
      for (int g = 0; g < VG; ++g) r[t][g] = V16::fma(pj, V16::load(vr + 16 * g), r[t][g]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < VG; ++g) acc[t][g] = r[t][g];
}

// the attention of (b, h)'s queries, in tiles of QT
void attend_head(const Args& a, int64_t b, int64_t h, Scratch& w) {
  const int64_t D = a.D, R = a.R;
  const int64_t* pos = a.pos + b * R;
  const bool* valid = a.valid == nullptr ? nullptr : a.valid + b * a.L;
  auto end_of = [&](int64_t r) {
    const int64_t p = pos[r];
    return p < 0 ? int64_t(0) : (p + 1 < a.n ? p + 1 : a.n);
  };
  int64_t jall = 0;  // keys any query of the head reads
  for (int64_t r = 0; r < R; ++r) jall = std::max(jall, end_of(r));
  if (valid != nullptr) {  // every key it reads valid (a canonical sequence's prefix): no per-key checks
    int64_t j = 0;
    while (j < jall && valid[j]) ++j;
    if (j == jall) valid = nullptr;
  }
  const int64_t ld = (jall + KL - 1) / KL * KL;
  w.kt.resize(D * (ld > DEC_BLOCKS * KL ? ld : DEC_BLOCKS * KL));
  w.q.resize(QT * D);
  w.sc.resize(QT * (ld + KL));
  w.p.resize(QT * (ld + KL));
  // the keys transposed once for every query tile, in blocks of 16: kt [ld / 16, D, 16], zeros past jall
  const float* kb = a.k + b * a.ks[0] + h * a.ks[1];
  const float* vb = a.v + b * a.vs[0] + h * a.vs[1];
  float* kt = w.kt.data();
  // one tile (a decode step): each key block transposed just before its scores, still in L1
  const bool one_tile = R <= QT;
  for (int64_t j0 = 0; j0 < ld && !one_tile; j0 += KL) {
    const int64_t kn = jall - j0 < KL ? jall - j0 : KL;
    transpose_keys(kb + j0 * a.ks[2], a.ks[2], kn, D, kt + j0 * D);
  }
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t sld = ld + KL;
  for (int64_t r0 = 0; r0 < R; r0 += QT) {
    const int64_t T = R - r0 < QT ? R - r0 : QT;
    int64_t end[QT], jend = 0;
    for (int64_t t = 0; t < QT; ++t) {
      end[t] = t < T ? end_of(r0 + t) : 0;
      jend = end[t] > jend ? end[t] : jend;
    }
    for (int64_t t = 0; t < QT; ++t) {
      if (t < T) {
        const float* qr = a.q + b * a.qs[0] + h * a.qs[1] + (r0 + t) * a.qs[2];
        for (int64_t d = 0; d < D; ++d) w.q[t * D + d] = qr[d] * a.scale;
      } else {
        for (int64_t d = 0; d < D; ++d) w.q[t * D + d] = 0.0f;
      }
    }
    float* sc = w.sc.data();
    // a single query (a decode step): DEC_BLOCKS key blocks transposed, in L1, then scored together
    for (int64_t j0 = 0; one_tile && T == 1 && j0 < jend; j0 += DEC_BLOCKS * KL) {
      const int64_t nb = std::min<int64_t>(DEC_BLOCKS, (jend - j0 + KL - 1) / KL);
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t js = j0 + i * KL;
        transpose_keys(kb + js * a.ks[2], a.ks[2], jall - js < KL ? jall - js : KL, D, kt + i * D * KL);
      }
      if (nb == 1) score_one_query<1>(w.q.data(), D, kt, j0, sc);
      else if (nb == 2) score_one_query<2>(w.q.data(), D, kt, j0, sc);
      else if (nb == 3) score_one_query<3>(w.q.data(), D, kt, j0, sc);
      else score_one_query<4>(w.q.data(), D, kt, j0, sc);
    }
    for (int64_t j0 = 0; !(one_tile && T == 1) && j0 < jend; j0 += KL) {
      const float* kj = kt + j0 * D;
      if (one_tile) {
        transpose_keys(kb + j0 * a.ks[2], a.ks[2], jall - j0 < KL ? jall - j0 : KL, D, kt);
        kj = kt;
      }
      for (int64_t t0 = 0; t0 < T; t0 += SCORE_NT) {
        const int64_t n = T - t0 < SCORE_NT ? T - t0 : SCORE_NT;
        const float* qt = w.q.data() + t0 * D;
        float* st = sc + t0 * sld;
        if (n == 1) score_block<1>(qt, D, kj, j0, st, sld);
        else if (n <= 2) score_block<2>(qt, D, kj, j0, st, sld);
        else if (n <= 4 || SCORE_NT == 4) score_block<(SCORE_NT < 4 ? SCORE_NT : 4)>(qt, D, kj, j0, st, sld);
        else score_block<SCORE_NT>(qt, D, kj, j0, st, sld);
      }
    }
    // per query: the max, the weights (whole lane blocks, 0 where not seen), the normaliser
    float den[QT], m[QT];
    for (int64_t t = 0; t < T; ++t) {
      const int64_t e = end[t];
      float* sm = w.sc.data() + t * sld;  // the scores, -inf where not seen (whole lane blocks)
      const int64_t epad = (e + KL - 1) / KL * KL;
      if (valid == nullptr) {
        for (int64_t j = e; j < epad; ++j) sm[j] = -inf;
      } else {
        for (int64_t j = 0; j < epad; ++j) sm[j] = j < e && valid[j] ? sm[j] : -inf;
      }
      V16 mx = V16::set1(-inf);
      for (int64_t j0 = 0; j0 < epad; j0 += KL) mx = V16::max(mx, V16::load(sm + j0));  // exact in any order
      float mlane[KL];
      mx.store(mlane);
      float mt = -inf;
      for (int64_t l = 0; l < KL; ++l) mt = mlane[l] > mt ? mlane[l] : mt;
      m[t] = mt;
      float* p = w.p.data() + t * sld;
      if (mt == -inf) {
        den[t] = 0.0f;
        continue;
      }
      const V16 mv = V16::set1(mt);
      V16 acc = V16::zero();
      for (int64_t j0 = 0; j0 < epad; j0 += KL) {  // -inf where not seen: 0
        const V16 pj = V16::exp_nonpos(V16::sub(V16::load(sm + j0), mv));
        pj.store(p + j0);
        acc = V16::add(acc, pj);  // lane l: keys 16 i + l, in key order
      }
      float lanes[KL];
      acc.store(lanes);
      for (int64_t width = KL / 2; width >= 1; width /= 2)
        for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      den[t] = lanes[0];
    }
    // the weighted values: per block of VBLOCK keys one fma chain per query over its seen keys, in order
    for (int64_t t = 0; t < T; ++t) {
      float* yr = a.y + ((b * a.H + h) * R + r0 + t) * D;
      for (int64_t d = 0; d < D; ++d) yr[d] = 0.0f;
    }
    // cmin: the keys every query of the tile that sees one sees (the ragged rest is taken query by query)
    int64_t cmin = jend;
    const float* prow[QT];
    for (int64_t t = 0; t < QT; ++t) {
      prow[t] = w.p.data() + t * sld;
      if (t < T && m[t] != -inf) cmin = end[t] < cmin ? end[t] : cmin;
    }
    for (int64_t c0 = 0; c0 < D; c0 += VC) {
      for (int64_t jb = 0; jb < jend; jb += VBLOCK) {
        const int64_t je = jb + VBLOCK < jend ? jb + VBLOCK : jend;
        const int64_t jc = cmin < jb ? jb : (cmin < je ? cmin : je);
        V16 part[QT][VG];
        for (int64_t t = 0; t < QT; ++t)
          for (int g = 0; g < VG; ++g) part[t][g] = V16::zero();
        for (int64_t t0 = 0; t0 < T && jc > jb; t0 += VALUE_NT) {
          const int64_t n = T - t0 < VALUE_NT ? T - t0 : VALUE_NT;
          if (n == 1) value_chain<1>(vb, a.vs[2], c0, D, jb, jc, valid, prow + t0, part + t0);
          else if (n <= 2) value_chain<2>(vb, a.vs[2], c0, D, jb, jc, valid, prow + t0, part + t0);
          else if (n <= 4 || VALUE_NT == 4) value_chain<(VALUE_NT < 4 ? VALUE_NT : 4)>(vb, a.vs[2], c0, D, jb, jc, valid, prow + t0, part + t0);
          else value_chain<VALUE_NT>(vb, a.vs[2], c0, D, jb, jc, valid, prow + t0, part + t0);
        }
        for (int64_t t = 0; t < T; ++t) {
          if (m[t] == -inf) continue;
          const int64_t jt = end[t] < je ? end[t] : je;
          if (jt > jc) value_chain<1>(vb, a.vs[2], c0, D, jc, jt, valid, prow + t, part + t);
          float* yr = a.y + ((b * a.H + h) * R + r0 + t) * D + c0;
          float buf[VC];
          for (int g = 0; g < VG; ++g) part[t][g].store(buf + 16 * g);
          const int64_t cn = D - c0 < VC ? D - c0 : VC;
          for (int64_t c = 0; c < cn; ++c) yr[c] += buf[c];
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      float* yr = a.y + ((b * a.H + h) * R + r0 + t) * D;
      float* lr = a.lse + (b * a.H + h) * R + r0 + t;
      if (m[t] == -inf) {  // sees no key: y = 0
        *lr = inf;
        continue;
      }
      for (int64_t d = 0; d < D; ++d) yr[d] = yr[d] / den[t];
      *lr = m[t] + std::log(den[t]);
    }
  }
}


std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& q_pos, const c10::optional<at::Tensor>& k_valid,
                                             int64_t length, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 q, k, v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q [B, H, R, D], k and v [B, H, L, D]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(), "k, v shapes");
  at::Tensor pos = q_pos.to(at::kLong).contiguous();
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == R, "q_pos [B, R]");
  at::Tensor val;
  if (k_valid.has_value() && k_valid->defined()) {
    val = k_valid->to(at::kBool).contiguous();
    TORCH_CHECK(val.dim() == 2 && val.size(0) == B && val.size(1) == L, "k_valid [B, L]");
  }
  at::Tensor y = at::empty({B, H, R, D}, q.options());
  at::Tensor lse = at::empty({B, H, R}, q.options());
  Args a;
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  for (int i = 0; i < 3; ++i) {
    a.qs[i] = q.stride(i);
    a.ks[i] = k.stride(i);
    a.vs[i] = v.stride(i);
  }
  a.pos = pos.data_ptr<int64_t>();
  a.valid = val.defined() ? val.data_ptr<bool>() : nullptr;
  a.y = y.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.H = H;
  a.R = R;
  a.D = D;
  a.L = L;
  a.n = length < L ? length : L;
  a.scale = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t stop) {
    Scratch w;
    for (int64_t i = begin; i < stop; ++i) attend_head(a, i / H, i % H, w);
  });
  return {y, lse};
}

}  // namespace

TORCH_LIBRARY(kltron_invariant, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor? k_valid, int length, float scale) -> (Tensor, Tensor)",
        &attention);
}
