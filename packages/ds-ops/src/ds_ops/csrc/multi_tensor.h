// Multi-tensor driver shared by the CPU optimizers: one OpenMP region splits the elements of all
// tensors of a call evenly across threads, and a dtype dispatcher instantiates only the supported
// (param, grad, state, copy) combinations.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace ds_ops {

// Per-tensor addresses, five int64 per tensor as Python lays them out: param, grad, state0, state1, copy.
struct Slot {
  int64_t param, grad, s0, s1, copy;
};

// Below this many elements per thread a parallel region costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// Thread boundaries inside a tensor fall on multiples of 64 elements (whole cache lines for every dtype).
constexpr int64_t kAlign = 64;

inline int64_t chunk_bound(int64_t x, int64_t n) {
  if (x <= 0) return 0;
  if (x >= n) return n;
  return x & ~(kAlign - 1);
}

// Calls fn(i, begin, end) for the element ranges of tensor i that this thread owns.
template <class Fn>
void for_each_chunk(const int64_t* numels, int64_t n_tensors, int nthreads, Fn&& fn) {
  int64_t total = 0;
  for (int64_t i = 0; i < n_tensors; ++i) total += numels[i];
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, total / kMinPerThread)));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = omp_get_thread_num();
    const int T = omp_get_num_threads();
    const int64_t lo = total / T * t + std::min<int64_t>(t, total % T);
    const int64_t hi = total / T * (t + 1) + std::min<int64_t>(t + 1, total % T);
    int64_t off = 0;
    for (int64_t i = 0; i < n_tensors && off < hi; ++i) {
      const int64_t n = numels[i];
      if (off + n > lo) {
        const int64_t b = chunk_bound(lo - off, n);
        const int64_t e = chunk_bound(hi - off, n);
        if (b < e) fn(i, b, e);
      }
      off += n;
    }
  }
}

template <class F>
int with_dtype(int code, F&& f) {
  switch (code) {
    case kF32: return f(static_cast<float*>(nullptr));
    case kBF16: return f(static_cast<bf16*>(nullptr));
    case kF16: return f(static_cast<fp16*>(nullptr));
    default: return -1;
  }
}

template <class T>
using tag_t = std::remove_pointer_t<T>;

// Error codes returned to Python: -1 unknown dtype, -2 grad dtype, -3 state dtype, -4 copy needs fp32 params.
// fn receives typed null pointers (P*, G*, S*, C*); C is float with a null copy pointer when there is no copy.
template <class F>
int dispatch(const int* dtypes, F&& fn) {
  return with_dtype(dtypes[0], [&](auto pt) {
    using P = tag_t<decltype(pt)>;
    return with_dtype(dtypes[1], [&](auto gt) {
      using G = tag_t<decltype(gt)>;
      if constexpr (!(std::is_same_v<G, P> || std::is_same_v<G, float>)) {
        return -2;
      } else {
        return with_dtype(dtypes[2], [&](auto st) {
          using S = tag_t<decltype(st)>;
          if constexpr (!(std::is_same_v<S, P> || std::is_same_v<S, float>)) {
            return -3;
          } else if constexpr (std::is_same_v<P, float>) {
            if (dtypes[3] == kNone) return fn(pt, gt, st, static_cast<float*>(nullptr));
            return with_dtype(dtypes[3], [&](auto ct) { return fn(pt, gt, st, ct); });
          } else {
            if (dtypes[3] != kNone) return -4;
            return fn(pt, gt, st, static_cast<float*>(nullptr));
          }
        });
      }
    });
  });
}

template <class T>
inline T* addr(int64_t a, int64_t offset) {
  return a == 0 ? nullptr : reinterpret_cast<T*>(a) + offset;
}

// Writes the updated param to the optional low-precision copy, past the cache when nt (streaming) is set.
template <class C>
inline void store_copy(C* c, Vec param, bool nt) {
  if (!c) return;
  if (nt) {
    store_stream(c, param);
  } else {
    store(c, param);
  }
}

// Runs block(p, g, s0, s1, c, nt) over n elements: whole vectors in place, then the last n % kW through
// zero-padded buffers so every element sees the same arithmetic. s1 (second state) and c (copy) may be null;
// the block then gets null for c, and a scratch buffer it ignores for s1.
template <class P, class G, class S, class C, class Block>
void run_range(P* p, const G* g, S* s0, S* s1, C* c, int64_t n, Block&& block) {
  const bool nt = can_stream(c);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) block(p + i, g + i, s0 + i, s1 ? s1 + i : nullptr, c ? c + i : nullptr, nt);
  if (nt) stream_fence();
  if (i == n) return;
  const int64_t rest = n - i;
  Tail<P> tp(p + i, rest);
  Tail<G> tg(const_cast<G*>(g + i), rest);  // read only: never flushed
  Tail<S> t0(s0 + i, rest);
  Tail<S> t1(s1 ? s1 + i : nullptr, s1 ? rest : 0);
  Tail<C> tc(c ? c + i : nullptr, c ? rest : 0);
  block(tp.buf, tg.buf, t0.buf, t1.buf, c ? tc.buf : nullptr, false);
  tp.flush();
  t0.flush();
  t1.flush();
  tc.flush();
}

// The body of every multi-tensor optimizer entry point: dispatches on the dtypes, then for each element range
// this thread owns runs block_for(t) (the vector step, built with tensor t's constants) through run_range.
template <class BlockFor>
int step_tensors(const int64_t* slots, const int64_t* numels, int64_t n_tensors, const int* dtypes, int nthreads,
                 BlockFor&& block_for) {
  const Slot* s = reinterpret_cast<const Slot*>(slots);
  return dispatch(dtypes, [&](auto pt, auto gt, auto st, auto ct) {
    using P = tag_t<decltype(pt)>;
    using G = tag_t<decltype(gt)>;
    using S = tag_t<decltype(st)>;
    using C = tag_t<decltype(ct)>;
    for_each_chunk(numels, n_tensors, nthreads, [&](int64_t t, int64_t b, int64_t e) {
      run_range(addr<P>(s[t].param, b), addr<const G>(s[t].grad, b), addr<S>(s[t].s0, b), addr<S>(s[t].s1, b),
                addr<C>(s[t].copy, b), e - b, block_for(t));
    });
    return 0;
  });
}

}  // namespace ds_ops

#define DS_OP_SIGNATURE                                                                                   \
  (const int64_t* slots, const int64_t* numels, const float* per_tensor, int64_t n_tensors, const float* hyper, \
   const int* dtypes, int nthreads)
