// Elementwise softmax math over rows of float / double, for the CPU kernels (COD attention's
// block rows, the loss's vocab rows). The float versions are built so that the compiler packs
// them into SIMD lanes (row_math.cpp says how); the double versions use std::exp, for the tight
// float64 tests.
#pragma once
#include <cstdint>

namespace peagle::cpu {

// x[j] = exp(x[j] - b)
void exp_shifted(float* x, int64_t n, float b);
void exp_shifted(double* x, int64_t n, double b);

// max over x[0..n) (-inf for n = 0) and the sum of x[0..n), each reduced in a fixed order
float span_max(const float* x, int64_t n);
double span_max(const double* x, int64_t n);
float span_sum(const float* x, int64_t n);
double span_sum(const double* x, int64_t n);

// dp[j] = p[j] * (dp[j] - delta): attention's dS from P and dP
void grad_scores(const float* p, float* dp, int64_t n, float delta);
void grad_scores(const double* p, double* dp, int64_t n, double delta);

// flags[i] = whether vector i of x (n vectors of length len, back to back) holds a NaN or an
// infinity; returns whether any does
bool non_finite_flags(const float* x, int64_t n, int64_t len, bool* flags);
bool non_finite_flags(const double* x, int64_t n, int64_t len, bool* flags);

// One KL row of the loss, q = softmax(xd) given as e[j] = exp(xd[j] - max) and inv_sum = 1 / sum e,
// p = softmax(xt) given by its log-normaliser lse_t:
//   g[j] = w * (q[j] - p[j]); returns sum_j p[j] * (log p[j] - log q[j]), with log q = xd - lse_d.
float kl_row(const float* xd, const float* xt, const float* e, int64_t n, float lse_d, float inv_sum, float lse_t,
             float w, float* g);

}  // namespace peagle::cpu
