// Memory-bandwidth references for benchmarks/cpu_adam.py: an in-place STREAM-like kernel and a plain
// C AdamW loop (28 bytes per element), both OpenMP parallel, no hand vectorization.
#include <omp.h>

#include <cmath>
#include <cstdint>

extern "C" {

// a = a * s + b, in place: 12 bytes of traffic per element.
void ds_probe_scale_add(float* a, const float* b, float s, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = a[i] * s + b[i];
}

// AdamW with bias correction as a straightforward loop; hyper: lr, beta1, beta2, eps, weight_decay, step.
void ds_probe_plain_adamw(float* p, const float* g, float* m, float* v, int64_t n, const float* hyper,
                          int nthreads) {
  const float lr = hyper[0], b1 = hyper[1], b2 = hyper[2], eps = hyper[3], wd = hyper[4];
  const float bc1 = 1.0f - std::pow(b1, hyper[5]);
  const float bc2_sqrt = std::sqrt(1.0f - std::pow(b2, hyper[5]));
  const float step_size = lr / bc1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * (1.0f - lr * wd) - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
  }
}
}
