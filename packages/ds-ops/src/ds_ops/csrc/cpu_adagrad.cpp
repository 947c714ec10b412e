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
  if (c) {
    if (nt) {
      store_stream(c, param);
    } else {
      store(c, param);
    }
  }
}

template <class P, class G, class S, class C>
void adagrad_range(P* p, const G* g, S* sum, C* c, int64_t n, const AdagradConsts& k) {
  const bool nt = can_stream(c);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) adagrad_block(p + i, g + i, sum + i, c ? c + i : nullptr, nt, k);
  if (nt) stream_fence();
  if (i == n) return;
  Tail<P> tp(p + i, n - i);
  Tail<G> tg(const_cast<G*>(g + i), n - i);
  Tail<S> ts(sum + i, n - i);
  if (c) {
    Tail<C> tc(c + i, n - i);
    adagrad_block(tp.buf, tg.buf, ts.buf, tc.buf, false, k);
    tc.flush();
  } else {
    adagrad_block(tp.buf, tg.buf, ts.buf, static_cast<C*>(nullptr), false, k);
  }
  tp.flush();
  ts.flush();
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, eps, weight_decay; per_tensor unused.
extern "C" int ds_cpu_adagrad_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  (void)per_tensor;
  const Slot* s = reinterpret_cast<const Slot*>(slots);
  const AdagradConsts k{set1(hyper[0]), set1(hyper[1]), set1(hyper[2]), hyper[2] != 0.0f};
  return dispatch(dtypes, [&](auto pt, auto gt, auto st, auto ct) {
    using P = tag_t<decltype(pt)>;
    using G = tag_t<decltype(gt)>;
    using S = tag_t<decltype(st)>;
    using C = tag_t<decltype(ct)>;
    for_each_chunk(numels, n_tensors, nthreads, [&](int64_t t, int64_t b, int64_t e) {
      adagrad_range(addr<P>(s[t].param, b), addr<const G>(s[t].grad, b), addr<S>(s[t].s0, b),
                    addr<C>(s[t].copy, b), e - b, k);
    });
    return 0;
  });
}
