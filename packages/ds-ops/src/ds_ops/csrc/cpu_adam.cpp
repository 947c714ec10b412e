// Adam / AdamW step over many tensors in one pass: reads param, grad, exp_avg, exp_avg_sq once and
// writes param, the two moments and (optionally) a low-precision copy of the updated param.
#include "multi_tensor.h"

namespace ds_ops {
namespace {

struct AdamConsts {
  Vec beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt;
  bool adamw, has_decay;
};

template <class P, class G, class S, class C>
inline void adam_block(P* p, const G* g, S* m, S* v, C* c, bool nt, const AdamConsts& k) {
  Vec grad = load(g);
  Vec param = load(p);
  if (k.has_decay) {
    if (k.adamw) {
      param = param * k.decay;  // decoupled: p *= 1 - lr * wd
    } else {
      grad = fma(param, k.weight_decay, grad);  // L2: g += wd * p
    }
  }
  const Vec exp_avg = fma(load(m), k.beta1, grad * k.one_minus_beta1);
  const Vec exp_avg_sq = fma(load(v), k.beta2, (grad * grad) * k.one_minus_beta2);
  const Vec denom = fma(vsqrt(exp_avg_sq), k.inv_bc2_sqrt, k.eps);
  param = param - k.step_size * (exp_avg / denom);
  store(p, param);
  store(m, exp_avg);
  store(v, exp_avg_sq);
  store_copy(c, param, nt);
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, beta1, beta2, eps, weight_decay, adamw (0/1); per_tensor: (step_size, 1/sqrt(bias_correction2)).
extern "C" int ds_cpu_adam_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  const float lr = hyper[0], b1 = hyper[1], b2 = hyper[2], wd = hyper[4];
  return step_tensors(slots, numels, n_tensors, dtypes, nthreads, [&](int64_t t) {
    const AdamConsts k{set1(b1), set1(1.0f - b1), set1(b2), set1(1.0f - b2), set1(hyper[3]), set1(wd),
                       set1(1.0f - lr * wd), set1(per_tensor[2 * t]), set1(per_tensor[2 * t + 1]),
                       hyper[5] != 0.0f, wd != 0.0f};
    return [k](auto* p, auto* g, auto* m, auto* v, auto* c, bool nt) { adam_block(p, g, m, v, c, nt, k); };
  });
}
