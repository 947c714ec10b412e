// Identity of a built op library: Python checks these after loading a cached build.
#include <omp.h>

#include "simd.h"

extern "C" {
const char* ds_ops_simd_level() { return ds_ops::kSimdName; }
int ds_ops_abi_version() { return 1; }
int ds_ops_omp_max_threads() { return omp_get_max_threads(); }
}
