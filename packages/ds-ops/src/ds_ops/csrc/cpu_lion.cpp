// Lion step over many tensors in one pass: p = p * (1 - lr*wd) - lr * sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g.
#include "multi_tensor.h"

namespace ds_ops {
namespace {

struct LionConsts {
  Vec lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
  bool has_decay;
};

template <class P, class G, class S, class C>
inline void lion_block(P* p, const G* g, S* m, C* c, bool nt, const LionConsts& k) {
  const Vec grad = load(g);
  const Vec exp_avg = load(m);
  Vec param = load(p);
  if (k.has_decay) param = param * k.decay;
  const Vec direction = vsign(fma(exp_avg, k.beta1, grad * k.one_minus_beta1));
  param = param - k.lr * direction;
  store(p, param);
  store(m, fma(exp_avg, k.beta2, grad * k.one_minus_beta2));
  store_copy(c, param, nt);
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, beta1, beta2, weight_decay; per_tensor unused.
extern "C" int ds_cpu_lion_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  (void)per_tensor;
  const float lr = hyper[0], b1 = hyper[1], b2 = hyper[2], wd = hyper[3];
  const LionConsts k{set1(lr), set1(b1), set1(1.0f - b1), set1(b2), set1(1.0f - b2), set1(1.0f - lr * wd), wd != 0.0f};
  return step_tensors(slots, numels, n_tensors, dtypes, nthreads, [&](int64_t) {
    return [&](auto* p, auto* g, auto* m, auto*, auto* c, bool nt) { lion_block(p, g, m, c, nt, k); };
  });
}
