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
  if (c) {
    if (nt) {
      store_stream(c, param);
    } else {
      store(c, param);
    }
  }
}

template <class P, class G, class S, class C>
void lion_range(P* p, const G* g, S* m, C* c, int64_t n, const LionConsts& k) {
  const bool nt = can_stream(c);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) lion_block(p + i, g + i, m + i, c ? c + i : nullptr, nt, k);
  if (nt) stream_fence();
  if (i == n) return;
  Tail<P> tp(p + i, n - i);
  Tail<G> tg(const_cast<G*>(g + i), n - i);
  Tail<S> tm(m + i, n - i);
  if (c) {
    Tail<C> tc(c + i, n - i);
    lion_block(tp.buf, tg.buf, tm.buf, tc.buf, false, k);
    tc.flush();
  } else {
    lion_block(tp.buf, tg.buf, tm.buf, static_cast<C*>(nullptr), false, k);
  }
  tp.flush();
  tm.flush();
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, beta1, beta2, weight_decay; per_tensor unused.
extern "C" int ds_cpu_lion_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  (void)per_tensor;
  const float lr = hyper[0], b1 = hyper[1], b2 = hyper[2], wd = hyper[3];
  const Slot* s = reinterpret_cast<const Slot*>(slots);
  const LionConsts k{set1(lr), set1(b1), set1(1.0f - b1), set1(b2), set1(1.0f - b2), set1(1.0f - lr * wd), wd != 0.0f};
  return dispatch(dtypes, [&](auto pt, auto gt, auto st, auto ct) {
    using P = tag_t<decltype(pt)>;
    using G = tag_t<decltype(gt)>;
    using S = tag_t<decltype(st)>;
    using C = tag_t<decltype(ct)>;
    for_each_chunk(numels, n_tensors, nthreads, [&](int64_t t, int64_t b, int64_t e) {
      lion_range(addr<P>(s[t].param, b), addr<const G>(s[t].grad, b), addr<S>(s[t].s0, b), addr<C>(s[t].copy, b),
                 e - b, k);
    });
    return 0;
  });
}
