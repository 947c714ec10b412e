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
  if (c) {
    if (nt) {
      store_stream(c, param);
    } else {
      store(c, param);
    }
  }
}

template <class P, class G, class S, class C>
void adam_range(P* p, const G* g, S* m, S* v, C* c, int64_t n, const AdamConsts& k) {
  const bool nt = can_stream(c);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) adam_block(p + i, g + i, m + i, v + i, c ? c + i : nullptr, nt, k);
  if (nt) stream_fence();
  if (i == n) return;
  Tail<P> tp(p + i, n - i);
  Tail<G> tg(const_cast<G*>(g + i), n - i);
  Tail<S> tm(m + i, n - i), tv(v + i, n - i);
  if (c) {
    Tail<C> tc(c + i, n - i);
    adam_block(tp.buf, tg.buf, tm.buf, tv.buf, tc.buf, false, k);
    tc.flush();
  } else {
    adam_block(tp.buf, tg.buf, tm.buf, tv.buf, static_cast<C*>(nullptr), false, k);
  }
  tp.flush();
  tm.flush();
  tv.flush();
}

}  // namespace
}  // namespace ds_ops

// hyper: lr, beta1, beta2, eps, weight_decay, adamw (0/1); per_tensor: (step_size, 1/sqrt(bias_correction2)).
extern "C" int ds_cpu_adam_step DS_OP_SIGNATURE {
  using namespace ds_ops;
  const float lr = hyper[0], b1 = hyper[1], b2 = hyper[2], wd = hyper[4];
  const Slot* s = reinterpret_cast<const Slot*>(slots);
  return dispatch(dtypes, [&](auto pt, auto gt, auto st, auto ct) {
    using P = tag_t<decltype(pt)>;
    using G = tag_t<decltype(gt)>;
    using S = tag_t<decltype(st)>;
    using C = tag_t<decltype(ct)>;
    for_each_chunk(numels, n_tensors, nthreads, [&](int64_t t, int64_t b, int64_t e) {
      const AdamConsts k{set1(b1), set1(1.0f - b1), set1(b2), set1(1.0f - b2), set1(hyper[3]), set1(wd),
                         set1(1.0f - lr * wd), set1(per_tensor[2 * t]), set1(per_tensor[2 * t + 1]),
                         hyper[5] != 0.0f, wd != 0.0f};
      adam_range(addr<P>(s[t].param, b), addr<const G>(s[t].grad, b), addr<S>(s[t].s0, b), addr<S>(s[t].s1, b),
                 addr<C>(s[t].copy, b), e - b, k);
    });
    return 0;
  });
}
