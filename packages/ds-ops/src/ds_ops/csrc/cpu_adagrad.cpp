// Adagrad step over many tensors in one pass (L2 weight decay, no lr decay), same layout as cpu_adam.
#include "multi_tensor.h"

namespace ds_ops {
namespace {

struct AdagradConsts {
  Vec lr, eps, weight_decay;
  bool has_decay;
};

template <class P, class G, class S, class C>
inline void adagrad_block(P* p, const G* g, S* sum, C* c, bool nt, const AdagradConsts& k) {
  Vec grad = load(g);
  Vec param = load(p);
  if (k.has_decay) grad = fma(param, k.weight_decay, grad);
  const Vec acc = fma(grad, grad, load(sum));
  param = param - k.lr * (grad / (vsqrt(acc) + k.eps));
  store(p, param);
  store(sum, acc);
  store_copy(c, param, nt);
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, eps, weight_decay; per_tensor unused.
extern "C" int ds_cpu_adagrad_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  (void)per_tensor;
  const AdagradConsts k{set1(hyper[0]), set1(hyper[1]), set1(hyper[2]), hyper[2] != 0.0f};
  return step_tensors(slots, numels, n_tensors, dtypes, nthreads, [&](int64_t) {
    return [&](auto* p, auto* g, auto* sum, auto*, auto* c, bool nt) { adagrad_block(p, g, sum, c, nt, k); };
  });
}
